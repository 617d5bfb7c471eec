"""Tensor-parallel shapes: which TPs the semantic and kernel levels run, and each rank's sizes.

Users serve MiniMax-M3 with tensor parallelism (the seed: TP=8 on eight SM89 cards). vLLM
then builds the attention layer once per rank: the file's own ``__init__`` divides the
config's head counts by the TP size - q heads ``total // tp``; KV heads ``total // tp``, or
one a rank where TP exceeds them (``max(1, total // tp)``, each replicated on ``tp // total``
ranks); index heads likewise - and vLLM's parallel linear layers return this rank's columns.
A bypass slices ``qkv`` and views k / v with exactly those sizes, so a slice written with the
TP=1 sizes is right at TP=1 only.

The model's head counts are MiniMax-M3's: read (never imported) from the installed vLLM's
config class (``vllm/transformers_utils/configs/minimax_m3.py``, the defaults of its
``MiniMaxM3TextConfig``: 64 q, 4 KV and 4 index heads in vLLM 0.24), else the stand-in's,
in the same proportions (:data:`STAND_IN`). By default the levels run TP=1, the smallest TP
that shards the KV heads and the smallest that replicates them (:func:`plans`); each extra TP
runs its first and its last rank, at a few tokens. A TP chosen with ``--tp`` runs every rank.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .layercode import Parallel, Shape

CONFIG_FILE = ("transformers_utils", "configs", "minimax_m3.py")  # under the vllm package
CONFIG_CLASS = "MiniMaxM3TextConfig"
TOKENS = 12  # an extra TP's batch (3 of them padded): the slices are what is checked, not the batch


@dataclass(frozen=True)
class Heads:
    """MiniMax-M3's head counts across all ranks, and where they were read."""

    q: int
    kv: int
    index: int
    source: str

    def __str__(self) -> str:
        return f"{self.q} q / {self.kv} kv / {self.index} index heads, {self.source}"


# MiniMax-M3's proportions (64 : 4 : 4 in vLLM 0.24's config class) at the stand-in's scale.
STAND_IN = Heads(32, 2, 2, "the stand-in's in MiniMax-M3's proportions (no vLLM config class here)")


def read_config_heads(source: str, where: str) -> Heads | None:
    """The q / KV / index head counts a config class's ``__init__`` defaults to (and its default
    ``sparse_attention_config``), where ``source`` defines one; else None."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CONFIG_CLASS):
        init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        if init is None:
            continue
        args = [*init.args.posonlyargs, *init.args.args]
        defaults = dict(zip([a.arg for a in args][len(args) - len(init.args.defaults) :], init.args.defaults))
        defaults |= {a.arg: d for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults) if d is not None}
        counts = [getattr(defaults.get(n), "value", None) for n in ("num_attention_heads", "num_key_value_heads")]
        index = [
            value.value
            for node in ast.walk(init)
            if isinstance(node, ast.Dict)
            for key, value in zip(node.keys, node.values)
            if isinstance(key, ast.Constant) and key.value == "sparse_num_index_heads"
            if isinstance(value, ast.Constant)
        ]
        values = [*counts, *index[:1]]
        if len(values) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            return Heads(*values, source=where)
    return None


@functools.lru_cache(maxsize=1)
def model_heads() -> Heads:
    """MiniMax-M3's head counts from the config class of this interpreter's vLLM (found with
    ``importlib.util.find_spec``, read, never imported), else :data:`STAND_IN`."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder).joinpath(*CONFIG_FILE)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        try:
            version = f"vLLM {importlib.metadata.version('vllm')}"
        except importlib.metadata.PackageNotFoundError:
            version = "the installed vLLM"
        heads = read_config_heads(text, f"MiniMax-M3's ({version}'s {CONFIG_CLASS})")
        if heads is not None:
            return heads
    return STAND_IN


def unshardable(heads: Heads, size: int) -> str | None:
    """Why vLLM cannot build MiniMax-M3's attention at TP=``size`` (its own asserts), or None."""
    if size < 1:
        return f"TP={size}: a tensor-parallel size is at least 1"
    if heads.q % size:
        return f"TP={size}: {heads.q} q heads do not divide over {size} ranks"
    if size <= heads.kv and heads.kv % size:
        return f"TP={size}: {heads.kv} KV heads do not divide over {size} ranks"
    if size > heads.kv and size % heads.kv:
        return f"TP={size}: {size} ranks do not replicate {heads.kv} KV heads evenly"
    return None


@dataclass(frozen=True)
class Plan:
    """One TP the level runs: its size, the ranks it runs, the model's heads (None at TP=1,
    where the shape's own counts are the model's) and what it does with the KV heads."""

    size: int
    ranks: tuple[int, ...] = (0,)
    heads: Heads | None = None

    @property
    def role(self) -> str:
        if self.heads is None or self.size == 1:
            return ""
        kv = self.heads.kv
        if self.size <= kv:
            return f"shards the {kv} KV heads, {kv // self.size} a rank"
        return f"replicates each of the {kv} KV heads on {self.size // kv} ranks"

    @property
    def label(self) -> str:
        """The level's name suffix: empty at TP=1 (the level's own row)."""
        return "" if self.size == 1 else f" TP={self.size}"

    def describe(self) -> str:
        """What the row ran: the ranks, the TP's way with the KV heads, whose heads."""
        if self.heads is None or self.size == 1:
            return "TP=1"
        ranks = ", ".join(str(r) for r in self.ranks)
        h, n = self.heads, self.size
        return (
            f"TP={n} ranks {ranks} ({self.role}): {h.q // n} q / {max(1, h.kv // n)} kv / "
            f"{max(1, h.index // n)} index heads a rank, of {h.q} / {h.kv} / {h.index}, {h.source}"
        )

    def shape(self, base: Shape, rank: int) -> Shape:
        """``base`` (the level's sizes) as rank ``rank`` sees it: the head counts this rank's
        ``__init__`` computes from the model's, head sizes unchanged, a few tokens."""
        if self.heads is None or self.size == 1:
            return base
        h, size = self.heads, self.size
        return replace(
            base,
            tokens=min(base.tokens, TOKENS),
            num_heads=h.q // size,
            num_kv_heads=h.kv // size if size <= h.kv else 1,
            num_idx_heads=max(1, h.index // size),
            parallel=Parallel(size, rank, h.q, h.kv, h.index),
        )


def plans(chosen: Sequence[int] = (), heads: Heads | None = None) -> list[Plan]:
    """TP=1, then each chosen TP (every rank), or by default the smallest TP that shards the KV
    heads and the smallest that replicates them (first and last rank). Raises ValueError for a
    chosen TP that MiniMax-M3's heads do not shard over."""
    heads = heads or model_heads()
    first = Plan(1)
    if chosen:
        for size in chosen:
            why = unshardable(heads, size)
            if why is not None:
                raise ValueError(f"--tp {size}: {why.split(': ', 1)[1]} (MiniMax-M3: {heads})")
        return [first, *(Plan(size, tuple(range(size)), heads) for size in sorted(set(chosen)) if size > 1)]
    sharding = next((n for n in range(2, heads.kv + 1) if unshardable(heads, n) is None), None)
    replicating = next((n for n in range(heads.kv + 1, heads.q + 1) if unshardable(heads, n) is None), None)
    return [first, *(Plan(n, (0, n - 1), heads) for n in (sharding, replicating) if n is not None)]
