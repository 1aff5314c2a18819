"""The driver and generate(custom_generate=...) keep the top-p tokens generate keeps on tied
logits (``top_p_ties="by_index"``, transformers' TopPLogitsWarper), not the whole tie group."""

import pytest
import torch

from specdec_kernels.hf import CUSTOM_GENERATE, speculative_generate
from specdec_kernels.reference.sampling import processed_probs

from ..ops._stats import ALPHA, chi_square_pvalue
from ._models import tiny_model

pytest.importorskip("transformers")

V, N = 8, 400
PROMPT = [3, 4, 5, 6]  # no repeated n-gram: prompt lookup drafts nothing, the token is p's bonus


def _tied_model():
    """A tiny target whose next-token logits after PROMPT are 3.0 for tokens 0-3 (identical output
    rows: exactly equal) and 0 for tokens 4-7. At top_p = 0.5 the boundary falls in the first group
    (each token 0.238 of the mass): generate keeps three of the four, tokens 1, 2, 3."""
    model = tiny_model("llama", vocab=V, seed=21)
    seen = {}
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: seen.setdefault("h", args[0][0, -1].detach()))
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPT]))
        handle.remove()
        h = seen["h"]
        head.weight.zero_()
        head.weight[:4] = 3.0 * h / h.dot(h)
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1].float()
    assert bool((logits[:4] == logits[0]).all()) and bool((logits[4:] == 0).all()), logits
    return model, logits


def test_sampled_tokens_follow_generates_top_p_on_ties():
    model, logits = _tied_model()
    ids = torch.tensor([PROMPT] * N)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=0.5, max_new_tokens=1, eos_token_id=[])
    torch.manual_seed(0)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[:, -1]
    assert set(plain.tolist()) == {1, 2, 3}  # generate never emits token 0
    torch.manual_seed(1)
    ours = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        prompt_lookup_num_tokens=2,
        custom_generate=CUSTOM_GENERATE,
        trust_remote_code=True,
        **kw,
    )[:, -1]
    p = processed_probs(logits, 1.0, 0, 0.5, "by_index")
    assert p[0] == 0 and bool((p[1:4] > 0).all())
    assert chi_square_pvalue(ours, p) > ALPHA
    # the whole-group rule emits token 0 about a quarter of the time: the test tells them apart
    keep = speculative_generate(
        model,
        None,
        ids,
        drafter="prompt_lookup",
        max_new_tokens=1,
        temperature=1.0,
        top_p=0.5,
        top_p_ties="keep",
        seed=2,
        eos_token_id=[],
    )
    assert int((keep.sequences[:, -1] == 0).sum()) > N // 8
