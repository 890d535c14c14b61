"""Which vLLM KV connectors support the hybrid KV cache manager (SupportsHMA), per release.

config/vllm.py (0.33.0): with no explicit --disable-hybrid-kv-cache-manager choice, a
`--kv-transfer-config` whose connector lacks SupportsHMA turns the hybrid KV cache manager off, and
sliding-window / chunked layers then keep every token like full attention.
"""

from __future__ import annotations

from vllm_ctxmgr.core.json_types import JSONObject
from vllm_ctxmgr.core.serve_args import ServeArgs

VllmVersion = tuple[int, int, int]

# distributed/kv_transfer/kv_connector/factory.py registrations whose class subclasses SupportsHMA
# (kv_connector/v1/base.py). MultiConnector supports it only when every child does
# (multi_connector.py all_children_support_hma). Per release: the set grows.
HMA_CONNECTORS: dict[VllmVersion, frozenset[str]] = {
    (0, 33, 0): frozenset(
        {
            "ExampleHiddenStatesConnector",
            "NixlConnector",
            "NixlPullConnector",
            "NixlPushConnector",
            "HiSparseConnector",
            "MoRIIOConnector",
            "OffloadingConnector",
            "DecodeBenchConnector",
            "MooncakeConnector",
            "MooncakeStoreConnector",
            "SimpleCPUOffloadConnector",
        }
    ),
}
# registered in 0.33.0 without SupportsHMA (LMCacheMPConnector: the in-tree upstream class)
NON_HMA_CONNECTORS: dict[VllmVersion, frozenset[str]] = {
    (0, 33, 0): frozenset(
        {
            "ExampleConnector",
            "LMCacheConnectorV1",
            "LMCacheMPConnector",
            "FlexKVConnectorV1",
            "HF3FSKVConnector",
        }
    ),
}


def connector_supports_hma(config: JSONObject, version: VllmVersion) -> bool | None:
    """KVConnectorFactory.supports_hma_config for the release whose table ctxmgr has; None: unknown
    (another release, or a connector loaded from `kv_connector_module_path`)."""
    table = max((v for v in HMA_CONNECTORS if v <= version), default=None)
    if table is None or table[:2] != version[:2]:
        return None
    name = config.get("kv_connector")
    if name == "MultiConnector":
        extra = config.get("kv_connector_extra_config") or {}
        children = (extra.get("connectors") or []) if isinstance(extra, dict) else None
        if not isinstance(children, list):
            return None  # a shape vLLM's KVTransferConfig refuses at start: not for ctxmgr to guess
        if not children:
            return False
        answers = [connector_supports_hma(child, version) for child in children if isinstance(child, dict)]
        if False in answers:
            return False
        return None if None in answers or len(answers) != len(children) else True
    if name in HMA_CONNECTORS[table]:
        return True
    if name in NON_HMA_CONNECTORS[table]:
        return False
    return None


def hybrid_manager_off_by_connector(args: ServeArgs, version: VllmVersion) -> bool:
    """config/vllm.py: with no explicit choice, a connector without SupportsHMA turns the hybrid KV
    cache manager off, so sliding-window layers keep every token."""
    if not args.kv_transfer_config or args.disable_hybrid_kv_cache_manager:
        return False
    return connector_supports_hma(args.kv_transfer_config, version) is False
