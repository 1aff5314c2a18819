"""How an engine verifies a token tree with the fused ops: attention, decision, cache compaction.

Runs on CPU (Triton interpreter) or CUDA:  python python/tree_verification_example.py

The engine owns the model; here one attention layer with random weights stands in for it. Per
step it appends the tree's keys/values after each request's committed prefix, runs
``sk.tree_attention`` (each node sees the prefix and its ancestors), turns the outputs into logits,
lets ``sk.verify_tree`` pick the accepted root-to-node path, and keeps exactly that path's cache
entries (``accepted_nodes``), in order, right after the prefix.
"""

import torch

import specdec_kernels as sk

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
B, H, D, V, S_MAX = 2, 4, 64, 500, 256
gen = torch.Generator().manual_seed(0)
W_qkv = torch.randn(3, D, D, generator=gen).to(device, dtype) / D**0.5
W_out = torch.randn(D, V, generator=gen).to(device, dtype)
embed = torch.randn(V, H * D, generator=gen).to(device, dtype)

# Two requests with ragged committed prefixes already in the cache.
prefix_lens = torch.tensor([40, 13], device=device)
k_cache = torch.randn(B, H, S_MAX, D, generator=gen).to(device, dtype)
v_cache = torch.randn(B, H, S_MAX, D, generator=gen).to(device, dtype)

# Root = the last committed token (node 0); two branches of drafts under it.
#   0 -> 1 -> 2        0 -> 3 -> 4 -> 5
parents = torch.tensor([[-1, 0, 1, 0, 3, 4], [-1, 0, 1, 0, 3, 4]], device=device)
tokens = torch.randint(0, V, (B, 6), generator=gen).to(device)
N = parents.shape[1]

slots = prefix_lens[:, None] + torch.arange(N, device=device)  # [B, N] cache slots of the nodes


def tree_logits(tokens):
    """1. Tree attention: write the nodes' K/V after each prefix, attend, project to logits."""
    x = embed[tokens].view(B, N, H, D).transpose(1, 2)  # [B, H, N, D]
    q, k, v = (x @ W_qkv[i] for i in range(3))
    for b in range(B):
        k_cache[b, :, slots[b]] = k[b]
        v_cache[b, :, slots[b]] = v[b]
    o = sk.tree_attention(q, k_cache, v_cache, prefix_lens, parents)  # [B, H, N, D]
    return o.mean(1) @ W_out  # [B, N, V]: row i scores the token after node i


# A drafter that guessed the first token of branch 0->1 right (the target's argmax after the root).
tokens[:, 1] = tree_logits(tokens)[:, 0].argmax(-1)
logits = tree_logits(tokens)

# 2. Verify: node i's target row is the row of its parent position; the root's own row is the bonus
#    for "nothing accepted". verify_tree takes [B, N+1, V]: row 0 for the root's children, row i+1
#    for node i's children. Here node 0 is the committed root, so drafts are nodes 1..5.
draft_parents = parents[:, 1:] - 1  # re-index drafts 1..5 as 0..4 under a virtual root (-1)
target_rows = logits  # row 0 = after root, row i = after draft i-1 (i = 1..5)
out = sk.verify_tree(target_rows, tokens[:, 1:], draft_parents, temperature=0.0)
print("accepted tokens:", [out.tokens[b, : int(out.num_accepted[b]) + 1].tolist() for b in range(B)])

# 3. Compact: keep the root and the accepted drafts' entries, contiguous after the prefix.
for b in range(B):
    n = int(out.num_accepted[b])
    path = [0] + [int(i) + 1 for i in out.accepted_nodes[b, :n]]  # tree node ids, root first
    keep = slots[b, path]
    k_cache[b, :, prefix_lens[b] : prefix_lens[b] + len(path)] = k_cache[b, :, keep].clone()
    v_cache[b, :, prefix_lens[b] : prefix_lens[b] + len(path)] = v_cache[b, :, keep].clone()
    print(
        f"request {b}: kept nodes {path}; committed length {int(prefix_lens[b])} -> {int(prefix_lens[b]) + len(path)}"
    )
