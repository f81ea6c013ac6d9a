"""Attention masks against element-wise reference predicates written with plain loops (docs/strategies.md §6, §14.4)."""

import pytest
import torch

from strategies.masks import build_block_diffusion_training_mask, create_idlm_block_mask, create_idlm_sdpa_mask


def idlm_reference(length, bs, valid):
    """Loop-by-loop M_BD ∪ M_OBC ∪ M_BC with key padding, as written in the spec."""
    batch = valid.shape[0]
    keep = torch.zeros(batch, 2 * length, 2 * length, dtype=torch.bool)
    for b in range(batch):
        for q in range(2 * length):
            for k in range(2 * length):
                qn, kn = q < length, k < length
                qp, kp = q % length, k % length
                if not valid[b, kp]:
                    continue
                if qn and kn:
                    keep[b, q, k] = qp // bs == kp // bs and q >= k
                elif qn and not kn:
                    keep[b, q, k] = qp // bs > kp // bs
                elif not qn and not kn:
                    keep[b, q, k] = q >= k
    return keep


@pytest.mark.parametrize("length,bs", [(4, 1), (6, 2)])
def test_idlm_dense_mask_equals_reference(length, bs):
    valid = torch.ones(2, length, dtype=torch.bool)
    valid[1, -1] = False
    mask = create_idlm_sdpa_mask(length, bs, valid, device="cpu", dtype=torch.float32)
    assert mask.shape == (2, 1, 2 * length, 2 * length)
    assert set(mask.unique().tolist()) == {0.0, float("-inf")}
    assert torch.equal(mask[:, 0] == 0, idlm_reference(length, bs, valid))


def test_idlm_padding_blocks_both_copies():
    valid = torch.tensor([[1, 1, 1, 0]])
    mask = create_idlm_sdpa_mask(4, 1, valid, device="cpu", dtype=torch.float32)
    assert (mask[0, 0, :, 3] == float("-inf")).all() and (mask[0, 0, :, 7] == float("-inf")).all()


def materialize(block_mask, batch, q_len, kv_len):
    """Element-wise view of a flex BlockMask: its block sparsity AND its mask_mod."""
    dense_blocks = block_mask.to_dense()  # [B, H, nQ, nKV] block-level
    bq, bk = block_mask.BLOCK_SIZE
    q = torch.arange(q_len)[:, None]
    k = torch.arange(kv_len)[None, :]
    out = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        in_block = dense_blocks[b, 0][q // bq, k // bk].bool()
        out[b] = in_block & block_mask.mask_mod(torch.tensor(b), torch.tensor(0), q, k)
    return out


@pytest.mark.parametrize("length,bs", [(4, 1), (6, 2)])
def test_idlm_flex_block_mask_materializes_to_reference(length, bs):
    valid = torch.ones(2, length, dtype=torch.bool)
    valid[0, -2:] = False
    block_mask = create_idlm_block_mask(length, bs, valid, device="cpu", use_compile=False)
    assert block_mask.shape[-2:] == (2 * length, 2 * length)
    assert torch.equal(materialize(block_mask, 2, 2 * length, 2 * length), idlm_reference(length, bs, valid))


def test_idlm_mask_hides_what_it_must_from_a_real_attention():
    """Leakage: perturbing a key the mask hides from query q leaves q's output unchanged."""
    length, bs = 6, 2
    mask = create_idlm_sdpa_mask(length, bs, torch.ones(1, length), device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 2, 2 * length, 8, generator=g) for _ in range(3)]
    base = torch.nn.functional.scaled_dot_product_attention(*qkv, attn_mask=mask)
    hidden_key = 3  # noisy token 3 (block 1): hidden from noisy block 0 and from every clean query
    k2, v2 = qkv[1].clone(), qkv[2].clone()
    k2[..., hidden_key, :] += 5
    v2[..., hidden_key, :] += 5
    moved = torch.nn.functional.scaled_dot_product_attention(qkv[0], k2, v2, attn_mask=mask)
    unaffected = (mask[0, 0, :, hidden_key] == float("-inf")).nonzero().flatten()
    affected = (mask[0, 0, :, hidden_key] == 0).nonzero().flatten()
    assert torch.equal(base[..., unaffected, :], moved[..., unaffected, :])
    assert not torch.allclose(base[..., affected, :], moved[..., affected, :])


# ------------------------------------------------------------------ block diffusion


def bd_reference(prefix, R, S, bs, W=None):
    batch = len(prefix)
    keep = torch.zeros(batch, R, S + R, dtype=torch.bool)
    for b, P in enumerate(prefix):
        for j in range(R):
            q = j // bs
            for e in range(S):
                rel = e - P
                beta = rel // bs if rel >= 0 else -1
                ok = q > beta and rel < R
                if W is not None:
                    ok = ok and e >= P + q * bs - W + 1
                keep[b, j, e] = ok
            for c in range(R):
                keep[b, j, S + c] = c // bs == q
    return keep


@pytest.mark.parametrize(
    "prefix,R,S,bs,W", [([0], 16, 16, 4, None), ([3, 6], 8, 16, 4, None), ([2, 5], 10, 20, 4, 8), ([6], 8, 16, 4, 16)]
)
def test_block_diffusion_mask_equals_reference(prefix, R, S, bs, W):
    full, sliding = build_block_diffusion_training_mask(torch.tensor(prefix), R, S, bs, sliding_window=W)
    assert full.shape == (len(prefix), 1, R, S + R) and full.dtype == torch.bool
    assert torch.equal(full[:, 0], bd_reference(prefix, R, S, bs))
    assert torch.equal(sliding[:, 0], bd_reference(prefix, R, S, bs, W))
    assert not (sliding & ~full).any()


def test_block_diffusion_no_answer_leak():
    """prefix 0, R = S = 16, bs = 4: block i sees encoder columns < 4i and none ≥ 4i."""
    full, _ = build_block_diffusion_training_mask(0, 16, 16, 4, batch_size=1)
    for j in range(16):
        i = j // 4
        assert full[0, 0, j, : 4 * i].all() and not full[0, 0, j, 4 * i : 16].any()
    ge_mask = torch.zeros(16, 16, dtype=torch.bool)
    for j in range(16):
        ge_mask[j, : 4 * (j // 4 + 1)] = True  # the leaky `≥` variant would show the own block
    assert not torch.equal(full[0, 0, :, :16], ge_mask)


def test_block_diffusion_additive_values_and_errors():
    full, _ = build_block_diffusion_training_mask(torch.tensor([2]), 4, 8, 4, dtype=torch.bfloat16)
    assert set(full.unique().tolist()) == {0.0, torch.finfo(torch.bfloat16).min}
    with pytest.raises(ValueError, match="batch_size"):
        build_block_diffusion_training_mask(2, 4, 8, 4)
    with pytest.raises(ValueError, match="1-D"):
        build_block_diffusion_training_mask(torch.zeros(1, 2), 4, 8, 4)
    with pytest.raises(ValueError, match="batch_size is 3"):
        build_block_diffusion_training_mask(torch.tensor([1, 2]), 4, 8, 4, batch_size=3)
    with pytest.raises(ValueError, match=">= 0"):
        build_block_diffusion_training_mask(torch.tensor([-1]), 4, 8, 4)
    with pytest.raises(ValueError, match=r"enc_len \(8\) too small"):
        build_block_diffusion_training_mask(torch.tensor([6]), 4, 8, 4)


def test_block_diffusion_single_block_and_tail_padding():
    full, _ = build_block_diffusion_training_mask(torch.tensor([2]), 4, 10, 4)
    assert full[0, 0, :, :2].all() and not full[0, 0, :, 2:10].any()  # one block: prompt only
    assert full[0, 0, :, 10:].all()  # bidirectional inside the canvas block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention has no CPU backward in torch 2.13; GPU check")
@pytest.mark.parametrize("bs", [1, 2])
def test_idlm_flex_attention_matches_sdpa_on_gpu(bs):
    from torch.nn.attention.flex_attention import flex_attention

    length = 64
    valid = torch.ones(2, length, dtype=torch.bool, device="cuda")
    valid[1, -5:] = False
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 2 * length, 32, device="cuda", generator=g, requires_grad=True) for _ in range(3))
    dense = create_idlm_sdpa_mask(length, bs, valid, device="cuda", dtype=torch.float32)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    out = flex_attention(q, k, v, block_mask=create_idlm_block_mask(length, bs, valid, device="cuda"))
    assert torch.allclose(out, ref, atol=2e-3)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
