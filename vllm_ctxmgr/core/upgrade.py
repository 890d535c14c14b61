"""What a vLLM upgrade moves: one unit planned under two releases' rules, side by side. PURE.

A release changes the accounting a start follows (CUDA graphs inside the KV budget from 0.20, the
default utilisation, page sizes): the same unit on the same GPUs gets another KV pool, so another
concurrency, and a context that fitted may not (vLLM #43308: 55k -> 525k tokens 0.20 -> 0.21; #49878:
~40% 0.25.1 -> 0.26). `plan --service S --vllm-version NEW` answers it before an upgrade and verify
when the running or installed vLLM is not the one the last plan or start was made under.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from vllm_ctxmgr.core.plan import Plan


class CapacityMoveRecord(TypedDict):
    """CapacityMove.to_json(): the `vllm_upgrade` object of `plan --json` and `verify --json`."""

    from_vllm_version: str
    to_vllm_version: str
    max_model_len: int
    kv_cache_tokens_before: int | None
    kv_cache_tokens_after: int | None
    kv_cache_tokens_ratio: float | None
    max_concurrency_before: float | None
    max_concurrency_after: float | None
    max_context_before: int
    max_context_after: int
    fits_before: bool
    fits_after: bool


@dataclass(frozen=True)
class CapacityMove:
    """The same unit's plan under the release it was planned/started under and under another."""

    from_vllm_version: str
    to_vllm_version: str
    max_model_len: int
    kv_cache_tokens_before: int | None
    kv_cache_tokens_after: int | None
    max_concurrency_before: float | None
    max_concurrency_after: float | None
    max_context_before: int
    max_context_after: int
    fits_before: bool
    fits_after: bool

    @classmethod
    def between(cls, before: Plan, after: Plan) -> CapacityMove:
        return cls(
            from_vllm_version=_dotted(before.vllm_version),
            to_vllm_version=_dotted(after.vllm_version),
            max_model_len=after.max_model_len,
            kv_cache_tokens_before=before.kv_cache_tokens,
            kv_cache_tokens_after=after.kv_cache_tokens,
            max_concurrency_before=before.max_concurrency,
            max_concurrency_after=after.max_concurrency,
            max_context_before=before.max_context,
            max_context_after=after.max_context,
            fits_before=before.feasible,
            fits_after=after.feasible,
        )

    @classmethod
    def from_json(cls, record: CapacityMoveRecord) -> CapacityMove:
        """Back from to_json (the ratio is derived, not stored twice)."""
        return cls(
            from_vllm_version=record["from_vllm_version"],
            to_vllm_version=record["to_vllm_version"],
            max_model_len=record["max_model_len"],
            kv_cache_tokens_before=record["kv_cache_tokens_before"],
            kv_cache_tokens_after=record["kv_cache_tokens_after"],
            max_concurrency_before=record["max_concurrency_before"],
            max_concurrency_after=record["max_concurrency_after"],
            max_context_before=record["max_context_before"],
            max_context_after=record["max_context_after"],
            fits_before=record["fits_before"],
            fits_after=record["fits_after"],
        )

    @property
    def kv_cache_tokens_ratio(self) -> float | None:
        """The pool after over the pool before (1.0: unmoved); None where either is not known."""
        if not self.kv_cache_tokens_before or self.kv_cache_tokens_after is None:
            return None
        return round(self.kv_cache_tokens_after / self.kv_cache_tokens_before, 4)

    @property
    def moved(self) -> bool:
        """The pool, the concurrency or whether the context fits is not what it was."""
        return (
            self.kv_cache_tokens_before != self.kv_cache_tokens_after
            or self.fits_before != self.fits_after
            or self.max_context_before != self.max_context_after
        )

    def text(self) -> str:
        """One line: what the upgrade moves, in vLLM's own words for the pool ("KV cache size")."""
        parts = []
        before, after = self.kv_cache_tokens_before, self.kv_cache_tokens_after
        if before is not None and after is not None:
            ratio = self.kv_cache_tokens_ratio
            change = f" ({(ratio - 1) * 100:+.0f}%)" if ratio is not None else ""
            parts.append(f"KV cache size {before:,} -> {after:,} tokens{change}")
        if self.max_concurrency_before is not None and self.max_concurrency_after is not None:
            parts.append(
                f"maximum concurrency for {self.max_model_len:,} tokens per request "
                f"{self.max_concurrency_before:.2f}x -> {self.max_concurrency_after:.2f}x"
            )
        if self.fits_before and not self.fits_after:
            parts.append(f"max_model_len {self.max_model_len:,} no longer fits")
        elif self.fits_after and not self.fits_before:
            parts.append(f"max_model_len {self.max_model_len:,} fits now")
        else:
            fits = "still fits" if self.fits_after else "does not fit under either"
            parts.append(f"max_model_len {self.max_model_len:,} {fits}")
        head = f"vLLM {self.from_vllm_version} -> {self.to_vllm_version}"
        said = "; ".join(parts)
        return f"{head}: {said}" if self.moved else f"{head}: capacity unmoved ({said})"

    def to_json(self) -> CapacityMoveRecord:
        return {
            "from_vllm_version": self.from_vllm_version,
            "to_vllm_version": self.to_vllm_version,
            "max_model_len": self.max_model_len,
            "kv_cache_tokens_before": self.kv_cache_tokens_before,
            "kv_cache_tokens_after": self.kv_cache_tokens_after,
            "kv_cache_tokens_ratio": self.kv_cache_tokens_ratio,
            "max_concurrency_before": self.max_concurrency_before,
            "max_concurrency_after": self.max_concurrency_after,
            "max_context_before": self.max_context_before,
            "max_context_after": self.max_context_after,
            "fits_before": self.fits_before,
            "fits_after": self.fits_after,
        }


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))
