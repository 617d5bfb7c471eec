# mm3-codemod example: a fork-era MiniMax-M3 NVIDIA model file in the
# `needs-bypass` state. Written for mm3-codemod's tests and demo from the
# structure of the fork builds (not a copy of vLLM source); it compiles but is
# meant to be read and rewritten, not imported.
"""MiniMax-M3 (text backbone) for NVIDIA GPUs, fork build with the fused
QK-norm + RoPE + paged-KV insert kernel."""

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from vllm import _custom_ops as ops
from vllm.config import CacheConfig, VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.models.minimax_m3.common.indexer import MiniMaxM3Indexer
from vllm.models.minimax_m3.common.sparse_attention import (
    MiniMaxM3IndexerMetadata,
    MiniMaxM3SparseBackend,
    MiniMaxM3SparseMetadata,
    select_main_impl_cls,
)
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec


def _sparse_layer_ids(config: PretrainedConfig) -> set[int]:
    """Layers that use block-sparse attention; the rest are dense."""
    sparse_cfg = getattr(config, "sparse_attention_config", None) or {}
    return set(sparse_cfg.get("sparse_attention_layers", ()))


def qknorm_rope_only(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    eps: float,
) -> None:
    """Module-level convenience wrapper (used by the MTP drafter)."""
    ops.fused_minimax_m3_qknorm_rope_kv_insert(
        qkv,
        q_weight,
        k_weight,
        cos_sin_cache,
        positions,
        num_heads,
        num_kv_heads,
        rotary_dim,
        eps,
    )


class GemmaRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight: ``x * rsqrt(mean(x^2) + eps) * (1 + w)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * (1.0 + self.weight.float())).to(orig_dtype)


class MiniMaxM3Attention(nn.Module):
    """Dense full-attention layer (the layers that are not block-sparse)."""

    def __init__(
        self,
        config: PretrainedConfig,
        quant_config: QuantizationConfig | None = None,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        # Norm + rope only: the dense layer's cache is written by self.attn.
        ops.fused_minimax_m3_qknorm_rope_kv_insert(
            qkv,
            self.q_norm.weight,
            self.k_norm.weight,
            self.rotary_emb.cos_sin_cache,
            positions,
            self.num_heads,
            self.num_kv_heads,
            self.rotary_emb.rotary_dim,
            self.q_norm.variance_epsilon,
        )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        attn_output = self.attn(q, k, v)
        output, _ = self.o_proj(attn_output)
        return output


class MiniMaxM3SparseAttention(nn.Module, AttentionLayerBase):
    """Block-sparse attention with the lightning-indexer branch.

    Owns the fused q/k/v/index projection, the per-head norms, RoPE, the main
    paged K/V cache and the indexer with its index-key side cache.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        quant_config: QuantizationConfig | None = None,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
        topk_indices_buffer: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5

        # Index branch: one index-q head per KV head, a single index-key head.
        sparse_cfg = config.sparse_attention_config
        self.num_idx_heads = self.num_kv_heads
        self.idx_head_dim = sparse_cfg["sparse_index_dim"]
        self.index_q_size = self.num_idx_heads * self.idx_head_dim

        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            self.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.index_q_norm = GemmaRMSNorm(self.idx_head_dim, eps=config.rms_norm_eps)
        self.index_k_norm = GemmaRMSNorm(self.idx_head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
        )

        vllm_config = get_current_vllm_config()
        self.layer_name = f"{prefix}.attn"
        self.kv_cache_dtype = (
            cache_config.cache_dtype if cache_config is not None else "auto"
        )
        self.kv_cache_torch_dtype = kv_cache_dtype_str_to_dtype(
            self.kv_cache_dtype, vllm_config.model_config
        )
        # Indexer side-cache dtype, mirroring --kv-cache-dtype for the main
        # cache (--attention-config '{"indexer_kv_dtype": ...}').
        self.indexer_kv_dtype = vllm_config.attention_config.indexer_kv_dtype

        self.attn_backend = MiniMaxM3SparseBackend
        self.impl = select_main_impl_cls(kv_cache_dtype=self.kv_cache_dtype)(
            self.num_heads,
            self.head_dim,
            self.scaling,
            self.num_kv_heads,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        self.indexer = MiniMaxM3Indexer(
            num_index_heads=self.num_idx_heads,
            index_head_dim=self.idx_head_dim,
            prefix=self.layer_name,
            cache_config=cache_config,
            indexer_kv_dtype=self.indexer_kv_dtype,
            topk_indices_buffer=topk_indices_buffer,
        )

        # Register the main K/V cache so that the KV-cache manager allocates it.
        forward_context = vllm_config.compilation_config.static_forward_context
        if self.layer_name in forward_context:
            raise ValueError(f"Duplicate layer name: {self.layer_name}")
        forward_context[self.layer_name] = self
        self.kv_cache = torch.tensor([])  # replaced by bind_kv_cache

    def get_attn_backend(self) -> type[MiniMaxM3SparseBackend]:
        return self.attn_backend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        # Fork layout: (num_blocks, 2, block_size, num_kv_heads, head_dim).
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.kv_cache_torch_dtype,
        )

    def _insert_kv(
        self, key: torch.Tensor, value: torch.Tensor, index_key: torch.Tensor
    ) -> None:
        """Write main K/V and index-K into their paged caches.

        No-op during the profiling run, where caches are not yet bound and
        ``attn_metadata`` is None.
        """
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return
        main_meta = attn_metadata[self.layer_name]
        index_meta = attn_metadata[self.indexer.index_cache.prefix]
        assert isinstance(main_meta, MiniMaxM3SparseMetadata)
        assert isinstance(index_meta, MiniMaxM3IndexerMetadata)

        # Identity scale: unused for the bf16 cache, required arg of the op.
        key_cache, value_cache = self.kv_cache.unbind(1)
        scale = torch.ones((), device=key.device)
        ops.reshape_and_cache_flash(
            key.view(-1, self.num_kv_heads, self.head_dim),
            value.view(-1, self.num_kv_heads, self.head_dim),
            key_cache,
            value_cache,
            main_meta.slot_mapping,
            self.kv_cache_dtype,
            scale,
            scale,
        )

        # Index-key cache: single vector per token, scatter by slot.
        idx_cache = self.indexer.index_cache.kv_cache.view(-1, self.idx_head_dim)
        idx_cache[index_meta.slot_mapping] = index_key.to(idx_cache.dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        # One projection for everything: [q | k | v | index_q | index_k].
        qkv, _ = self.qkv_proj(hidden_states)
        num_tokens = qkv.shape[0]

        fwd_slot_mapping = get_forward_context().slot_mapping
        if not isinstance(fwd_slot_mapping, dict):
            # Memory-profiling run: caches are not bound yet.
            return qkv.new_zeros((num_tokens, self.hidden_size))

        main_slot_mapping = fwd_slot_mapping[self.layer_name]
        index_slot_mapping = fwd_slot_mapping[self.indexer.index_cache.prefix]
        q = qkv.new_empty((num_tokens, self.q_size))
        index_q = qkv.new_empty((num_tokens, self.index_q_size))
        # Gemma QK-norm + partial NeoX RoPE on q/k/index_q/index_k, k/v and
        # index_k scattered into the paged caches, q/index_q de-interleaved.
        ops.fused_minimax_m3_qknorm_rope_kv_insert(
            qkv,
            self.q_norm.weight,
            self.k_norm.weight,
            self.rotary_emb.cos_sin_cache,
            positions,
            self.num_heads,
            self.num_kv_heads,
            self.rotary_emb.rotary_dim,
            self.q_norm.variance_epsilon,
            self.index_q_norm.weight,
            self.index_k_norm.weight,
            self.num_idx_heads,
            main_slot_mapping,
            index_slot_mapping,
            self.kv_cache,
            self.indexer.index_cache.kv_cache,
            self.kv_cache.size(2),  # paged-cache block size
            q,
            index_q,
        )

        output = torch.empty_like(q)
        attn_output = self._run_attention(q, index_q, output)
        output, _ = self.o_proj(attn_output)
        return output

    def _run_attention(
        self, query: torch.Tensor, index_query: torch.Tensor, output: torch.Tensor
    ) -> torch.Tensor:
        # The indexer writes its top-k blocks into the shared buffer; the
        # sparse attend reads them back.
        self.indexer(index_query)
        return self.impl.forward(self, query, self.kv_cache, output)

    def index_metadata(self) -> MiniMaxM3IndexerMetadata | None:
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return None
        return attn_metadata.get(self.indexer.index_cache.prefix)


class MiniMaxM3DecoderLayer(nn.Module):
    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str,
        topk_indices_buffer: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        layer_id = int(prefix.split(".")[-1])
        attn_cls = (
            MiniMaxM3SparseAttention
            if layer_id in _sparse_layer_ids(config)
            else MiniMaxM3Attention
        )
        kwargs = {"topk_indices_buffer": topk_indices_buffer}
        if attn_cls is MiniMaxM3Attention:
            kwargs = {}
        self.self_attn = attn_cls(
            config=config,
            quant_config=vllm_config.quant_config,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
            **kwargs,
        )
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(
            config.hidden_size, config.rms_norm_eps
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return self.mlp(hidden_states), residual


def load_layer_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> set[str]:
    """Copy checkpoint tensors into parameters of the same name."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in params:
            params[name].data.copy_(tensor)
            loaded.add(name)
    return loaded
