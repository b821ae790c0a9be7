"""Task metadata shaped like upstream's (``metadata.py`` on main): same class and field names.

The instrumentation reads these by attribute name (research §4), so the replica must spell them the
way vLLM-Ascend does. They are plain mutable dataclasses, as upstream's are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReqMeta:
    """One request's part of a step (upstream ``ReqMeta``; only the fields the pipeline reads)."""

    req_id: str
    is_last_chunk: bool = True
    num_blocks: int = 0


@dataclass
class LayerBlockRange:
    request: ReqMeta
    start_block: int
    end_block: int
    partial_block_index: int | None = None


@dataclass
class SharedBlockData:
    """Per-step data shared by all layers of one KV cache group."""

    req_ids: list[str]
    is_last_chunks: list[bool]
    load_keys: list[str]
    block_ids_arr: list[int]
    step: int = 0
    """Replica only: the step this data belongs to (the fake backend derives copy times from it)."""


@dataclass
class LayerTransferTask:
    layer_id: int
    block_ranges: list[LayerBlockRange]
    group_id: int = 0
    layer_idx_in_group: int = 0
    shared_block_data: SharedBlockData | None = None
    step: int = 0
    """Replica only: the step this task belongs to."""


@dataclass
class LayerLoadTask:
    """What the forward enqueues on the recv thread: one per (step, layer)."""

    wait_for_save_layer: int | None
    transfer_tasks: list[LayerTransferTask]
    layer_id: int
    attention_start_gate: Any = None


@dataclass
class LayerBatchReqMeta:
    """Result of a builder's ``build_addrs``: addresses, sizes and GVAs for one layer of one group."""

    layer_id: int
    req_ids: list[str]
    is_last_chunks: list[bool]
    load_keys: list[str]
    addrs: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    gvas: list[int] = field(default_factory=list)
