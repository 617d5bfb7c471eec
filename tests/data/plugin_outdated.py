# mm3-codemod test data: the trimmed fork-era layer of fixtures/no_insert_kv after an older
# bypass, whose _insert_kv scatters the index keys by slot (slot -1 included); outdated.
import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype


class SparseAttentionLayer(nn.Module):
    def __init__(self, config, cache_config, vllm_config, prefix: str = "") -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.index_heads = self.kv_heads
        self.dim = config.head_dim
        self.index_dim = config.sparse_attention_config["sparse_index_dim"]
        self.q_width = self.heads * self.dim
        self.index_q_width = self.index_heads * self.index_dim
        self.layer_name = f"{prefix}.attn"
        self.kv_cache_dtype = cache_config.cache_dtype
        self.kv_cache_torch_dtype = kv_cache_dtype_str_to_dtype(
            self.kv_cache_dtype, vllm_config.model_config
        )
        # fp8 KV cache: the fused qknorm+rope+kv-insert op writes bf16 caches only;
        # forward() then runs it norm+rope-only and writes the cache via _insert_kv().
        self._fp8_kv = "fp8" in self.kv_cache_dtype
        self.register_buffer(
            "_fp8_kv_scale", torch.ones((), dtype=torch.float32), persistent=False
        )
        self.kv_cache = torch.tensor([])

    def _insert_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        index_key: torch.Tensor,
        main_slot_mapping: torch.Tensor,
        index_slot_mapping: torch.Tensor,
    ) -> None:
        """Write main K/V (fp8-quantizing) and index-K into their paged caches.

        Used only on the fp8-KV path, where the bf16-only fused op runs in
        norm+rope-only mode: ``reshape_and_cache_flash`` honours kv_cache_dtype.
        The index cache is copied (bf16) or stored x / 1 (fp8 e4m3), as the
        fused op does.
        """
        key_cache, value_cache = self.kv_cache.unbind(1)
        scale = self._fp8_kv_scale  # identity: stores x / 1
        torch.ops._C_cache_ops.reshape_and_cache_flash(
            key.view(-1, self.kv_heads, self.dim),
            value.view(-1, self.kv_heads, self.dim),
            key_cache,
            value_cache,
            main_slot_mapping,
            self.kv_cache_dtype,
            scale,
            scale,
        )
        # Index-key cache: one vector per token, scattered by slot (the older form).
        idx_cache = self.indexer.index_cache.kv_cache.view(-1, self.index_dim)
        idx_cache[index_slot_mapping] = index_key.to(idx_cache.dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        n = qkv.shape[0]
        slot_mapping = get_forward_context().slot_mapping
        main_slots = slot_mapping[self.layer_name]
        index_slots = slot_mapping[self.indexer.index_cache.prefix]
        kv_cache = self.kv_cache
        q = qkv.new_empty((n, self.q_width))
        index_q = qkv.new_empty((n, self.index_q_width))
        # fp8 KV cache: cache arguments None -> the fused op only norms/ropes in place.
        insert_via_fused = not self._fp8_kv
        torch.ops._C.fused_minimax_m3_qknorm_rope_kv_insert(
            qkv, self.q_norm.weight, self.k_norm.weight, self.rotary_emb.cos_sin_cache,
            positions, self.heads, self.kv_heads, self.rotary_emb.rotary_dim,
            self.q_norm.variance_epsilon, self.index_q_norm.weight,
            self.index_k_norm.weight, self.index_heads, main_slots, index_slots,
            (
                kv_cache if insert_via_fused else None
            ), (
                self.indexer.index_cache.kv_cache if insert_via_fused else None
            ), kv_cache.size(2), q, index_q,
        )
        if not insert_via_fused:
            # qkv is [q | k | v | index_q | index_k]: the fused op left k and
            # index_k (one index-key head) normed/roped in place and v raw; write
            # them (strided views) to the cache.
            kv = self.kv_heads * self.dim
            k0 = self.q_width
            ik0 = k0 + 2 * kv + self.index_q_width
            k = qkv[:, k0 : k0 + kv]
            v = qkv[:, k0 + kv : k0 + 2 * kv]
            index_k = qkv[:, ik0 : ik0 + self.index_dim]
            self._insert_kv(k, v, index_k, main_slots, index_slots)
        return self.attend(q, index_q)
