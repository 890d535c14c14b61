import argparse

from vllm.config import ModelConfig, VllmConfig


class EngineArgs:
    @staticmethod
    def add_cli_args(parser):
        model_kwargs = get_kwargs(ModelConfig)
        parser.add_argument("--model", **model_kwargs["max_model_len"])
        parser.add_argument("--max-model-len", **model_kwargs["max_model_len"])
        parser.add_argument("--hf-overrides", **model_kwargs["hf_overrides"])
        vllm_kwargs = get_kwargs(VllmConfig)
        parser.add_argument("--compilation-config", "-cc", **vllm_kwargs["compilation_config"])
        parser.add_argument("--optimization-level", **vllm_kwargs["optimization_level"])
        parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction)
        return parser


class AsyncEngineArgs(EngineArgs):
    @staticmethod
    def add_cli_args(parser):
        parser = EngineArgs.add_cli_args(parser)
        parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction)
        return parser
