"""How an inference engine calls the fused verification op inside its sampler step.

Runs on CPU (Triton interpreter) or CUDA:  python python/engine_integration_example.py

The engine owns the models and the KV cache; specdec_kernels only decides which drafted tokens
to keep. Per step the engine hands over the target's logits at the drafted positions (plus one
bonus row), the draft tokens, the draft's logits, per-request sampling parameters as tensors and
per-request seeds derived from (request seed, step) so every step gets fresh randomness.
"""

import torch

import specdec_kernels as sk

device = "cuda" if torch.cuda.is_available() else "cpu"
B, G, V = 4, 4, 1000  # requests in the batch, max drafts per request, vocabulary


def step_seeds(request_seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Fresh, batch-independent randomness per step: mix the step into each request's seed."""
    return request_seeds * 1_000_003 + step


def sampler_step(step, target_logits, draft_tokens, draft_logits, num_draft_tokens, params, request_seeds, kv_lens):
    out = sk.verify(
        target_logits,  # [B, G+1, V] bf16/fp16/fp32, straight from the LM head
        draft_tokens,  # [B, G]
        draft_logits,  # [B, G, V]
        temperature=params["temperature"],  # [B] (0 = greedy for that request)
        top_k=params["top_k"],
        top_p=params["top_p"],
        num_draft_tokens=num_draft_tokens,  # [B] ragged drafts
        seed=step_seeds(request_seeds, step),
        validate=False,  # the engine validated its own inputs: no host sync, graph-capturable
    )
    n = out.num_accepted.long()  # [B]
    # Commit out.tokens[b, : n[b] + 1]. The KV cache holds entries for the committed prefix plus
    # the n_b drafted tokens that were fed to the target; keep the accepted ones and drop the
    # rest (the emitted recovered/bonus token has no KV entry yet: it is the next step's input).
    new_kv_lens = kv_lens + n  # i.e. truncate the cache by num_draft_tokens - n entries
    committed = [out.tokens[b, : n[b] + 1].tolist() for b in range(B)]
    return committed, new_kv_lens


if __name__ == "__main__":
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(B, G + 1, V, generator=gen).to(device, torch.bfloat16)
    draft_logits = (target_logits[:, :G].float().cpu() + 0.5 * torch.randn(B, G, V, generator=gen)).to(device)
    q = torch.softmax(draft_logits.float(), -1).cpu()
    draft_tokens = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(B, G).to(device)
    params = {
        "temperature": torch.tensor([0.0, 0.7, 1.0, 1.2], device=device),
        "top_k": torch.tensor([0, 50, 0, 20], device=device),
        "top_p": torch.tensor([1.0, 0.9, 0.95, 1.0], device=device),
    }
    num_draft_tokens = torch.tensor([4, 2, 3, 0], device=device)
    request_seeds = torch.tensor([11, 22, 33, 44], device=device)
    kv_lens = torch.tensor([17, 5, 9, 30], device=device)
    committed, kv_lens = sampler_step(
        0, target_logits, draft_tokens, draft_logits, num_draft_tokens, params, request_seeds, kv_lens
    )
    for b in range(B):
        print(
            f"request {b}: drafted {int(num_draft_tokens[b])}, committed {committed[b]}, "
            f"KV length now {int(kv_lens[b])}"
        )
