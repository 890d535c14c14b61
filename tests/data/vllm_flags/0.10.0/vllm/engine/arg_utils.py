import argparse

from vllm.config import ModelConfig, SchedulerConfig


class EngineArgs:
    @staticmethod
    def add_cli_args(parser):
        model_kwargs = get_kwargs(ModelConfig)
        parser.add_argument("--model", **model_kwargs["max_model_len"])
        parser.add_argument("--max-model-len", **model_kwargs["max_model_len"])
        parser.add_argument("--rope-scaling", **model_kwargs["rope_scaling"])
        parser.add_argument("--compilation-config", "-O", **model_kwargs["compilation_config"])
        scheduler_kwargs = get_kwargs(SchedulerConfig)
        parser.add_argument("--max-num-seqs", **scheduler_kwargs["max_num_seqs"])
        parser.add_argument("--num-scheduler-steps", **scheduler_kwargs["num_scheduler_steps"])
        parser.add_argument("--cuda-graph-sizes", **scheduler_kwargs["cuda_graph_sizes"])
        parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction)
        return parser


class AsyncEngineArgs(EngineArgs):
    @staticmethod
    def add_cli_args(parser):
        parser = EngineArgs.add_cli_args(parser)
        parser.add_argument("--disable-log-requests", action="store_true")
        return parser
