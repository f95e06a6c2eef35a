"""Reference attention backend in plain torch: pads the ragged batch to
``[bs, max_q_len]`` queries x ``[bs, max_kv_len]`` keys, builds one boolean mask, one SDPA call per
layer. Supports every mode (extend, chunked extend, decode, tree verify, tree draft decode)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specmesh.runtime.attention.base import AttentionBackend, AttentionMetadata


class TorchBackend(AttentionBackend):
    name = "torch"
    needs_cpu_metadata = True

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        q_lens = meta.q_lens_cpu or (meta.qo_indptr[1:] - meta.qo_indptr[:-1]).tolist()
        kv_lens = meta.kv_lens_cpu or (meta.kv_indptr[1:] - meta.kv_indptr[:-1]).tolist()
        bs, max_q, max_kv = len(q_lens), max(q_lens), max(kv_lens)
        self.bs, self.max_q = bs, max_q
        if min(kv_lens) == max_kv:  # equal rows: the slot ids are already a [bs, max_kv] grid
            self.kv_slots = meta.kv_indices[: bs * max_kv].view(bs, max_kv)
        else:
            self.kv_slots = self._padded_slots(meta, kv_lens, max_kv)  # [bs, max_kv]
        uniform = min(q_lens) == max_q and min(kv_lens) == max_kv
        self.q_valid = None  # [bs, max_q] real query rows; None when every row is real
        if not uniform:
            self._prepare_mask(meta, q_lens, kv_lens, max_q, max_kv)
        elif meta.custom_mask is not None:  # equal shapes: the flat masks are a [bs, q, kv] grid
            grid = meta.custom_mask[: bs * max_q * max_kv].view(bs, 1, max_q, max_kv)
            self.mask = grid.to(torch.bool)
        elif max_q == 1:
            # Decode of equal-length rows: each query sees its whole row, no mask needed (SDPA
            # without a mask gives the same numbers as with an all-true one).
            self.mask = None
        else:
            dev = meta.qo_indptr.device
            q_pos, kv_pos = torch.arange(max_q, device=dev), torch.arange(max_kv, device=dev)
            causal = kv_pos[None, :] <= q_pos[:, None] + (max_kv - max_q)  # [max_q, max_kv]
            self.mask = causal[None, None].expand(bs, 1, max_q, max_kv)

    @staticmethod
    def _padded_slots(meta: AttentionMetadata, kv_lens: list[int], max_kv: int) -> torch.Tensor:
        dev = meta.kv_indptr.device
        kv_pos = torch.arange(max_kv, device=dev)
        kv_valid = kv_pos[None, :] < torch.tensor(kv_lens, device=dev)[:, None]  # [bs, max_kv]
        kv_flat = (meta.kv_indptr[:-1, None] + kv_pos[None, :]).clamp(
            max=max(meta.kv_indices.numel() - 1, 0)
        )
        return torch.where(kv_valid, meta.kv_indices[kv_flat], 0)

    def _prepare_mask(
        self,
        meta: AttentionMetadata,
        q_lens: list[int],
        kv_lens: list[int],
        max_q: int,
        max_kv: int,
    ) -> None:
        dev = meta.qo_indptr.device
        bs = len(q_lens)
        q_len_t = torch.tensor(q_lens, device=dev)
        kv_len_t = torch.tensor(kv_lens, device=dev)
        q_pos = torch.arange(max_q, device=dev)
        kv_pos = torch.arange(max_kv, device=dev)
        q_valid = q_pos[None, :] < q_len_t[:, None]  # [bs, max_q]
        kv_valid = kv_pos[None, :] < kv_len_t[:, None]  # [bs, max_kv]
        self.q_valid = q_valid
        if meta.custom_mask is None:
            offset = (kv_len_t - q_len_t)[:, None, None]
            mask = kv_pos[None, None, :] <= q_pos[None, :, None] + offset
        else:
            mask = torch.zeros(bs, max_q, max_kv, dtype=torch.bool, device=dev)
            start = meta.mask_indptr.tolist()
            for b in range(bs):
                m = meta.custom_mask[start[b] : start[b + 1]].view(q_lens[b], kv_lens[b])
                mask[b, : q_lens[b], : kv_lens[b]] = m
        mask = mask & kv_valid[:, None, :]
        # Padded query rows see column 0 only, so softmax stays finite; they are dropped after.
        mask[:, :, 0] |= ~q_valid
        self.mask = mask[:, None]  # [bs, 1, max_q, max_kv]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        bs, max_q = self.bs, self.max_q
        num_heads, head_dim = q.shape[1], q.shape[2]
        if max_q == 1:  # decode: one query per request, nothing to pad
            q_heads = q.unsqueeze(2)  # [bs, heads, 1, head_dim]
        elif self.q_valid is None:  # every request has max_q rows
            q_heads = q.view(bs, max_q, num_heads, head_dim).transpose(1, 2)
        else:
            q_pad = q.new_zeros(bs, max_q, num_heads, head_dim)
            q_pad[self.q_valid] = q
            q_heads = q_pad.transpose(1, 2)  # [bs, heads, max_q, head_dim]
        flat = self.kv_slots.flatten()
        keys = k_pool.index_select(0, flat).view(*self.kv_slots.shape, *k_pool.shape[1:])
        # [bs, max_kv, kv_heads, dim]; V may be narrower than K (MLA: V is K's latent columns)
        values = v_pool.index_select(0, flat).view(*self.kv_slots.shape, *v_pool.shape[1:])
        v_dim = values.shape[-1]
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q_heads,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self.mask,
            scale=scale,
            enable_gqa=num_heads != keys.shape[2],  # grouped-query heads without copying K/V
        )  # [bs, heads, max_q, v_dim]
        if max_q == 1:
            return out.reshape(bs, num_heads, v_dim)
        out = out.transpose(1, 2)  # [bs, max_q, heads, v_dim]
        return out.reshape(-1, num_heads, v_dim) if self.q_valid is None else out[self.q_valid]


def make_backend(
    name: str,
    device: str | torch.device | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    *,
    latent: bool = False,
) -> AttentionBackend:
    """Backends by name; GPU-only ones are imported here, lazily, so CPU never touches them.
    With ``device`` (and the model's ``head_dim`` / ``dtype``), a backend that cannot run the
    model there is refused now, at startup, not at the first request: compiled Triton kernels
    need a CUDA device (on CPU only under ``TRITON_INTERPRET=1``, the interpreter the tests
    use); FlashInfer needs CUDA, fp16 / bf16 and a head_dim its kernels are built for.
    ``latent``: the model is multi-head latent attention (V inside K), which ``torch`` and
    ``triton`` run (`kernels.mla_attention`), not yet ``flashinfer``."""
    if latent and name == "flashinfer":
        raise ValueError(
            "the flashinfer attention backend has no multi-head latent attention (DeepSeek-V3 "
            "MLA) kernel yet: use --attention-backend triton (or torch) for this model"
        )
    if device is not None:
        check_backend_device(name, torch.device(device))
    if name == "flashinfer" and head_dim is not None and dtype is not None:
        check_flashinfer_model(head_dim, dtype)
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from specmesh.runtime.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "flashinfer":
        from specmesh.runtime.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose torch, triton or flashinfer")


def check_backend_device(name: str, device: torch.device) -> None:
    if device.type == "cuda" or name == "torch":
        return
    if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    hint = " (or TRITON_INTERPRET=1, Triton's slow interpreter)" if name == "triton" else ""
    raise ValueError(
        f"the {name} attention backend needs a CUDA device, got --device {device}: use "
        f"--attention-backend torch on {device.type}{hint}"
    )


FLASHINFER_HEAD_DIMS = (64, 128, 256)


def check_flashinfer_model(head_dim: int, dtype: torch.dtype) -> None:
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"the flashinfer attention backend runs fp16 / bf16 models, this one is {dtype}: "
            "use --dtype bf16, or --attention-backend triton"
        )
    if head_dim not in FLASHINFER_HEAD_DIMS:
        raise ValueError(
            f"the flashinfer attention backend takes head_dim {FLASHINFER_HEAD_DIMS}, this model "
            f"has {head_dim}: use --attention-backend triton"
        )
