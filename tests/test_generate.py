"""Generation: greedy equality with transformers' generate, the KV cache against full recomputation, left-padded
batches, logits processors against transformers' own, seeds, EOS and stop strings, the context limit, and the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import chaotic_model, greedy_heads, hf_greedy, same_tokens_where_decided

from gpt2_port.cli import main
from gpt2_port.config import GPT2Config
from gpt2_port.errors import UsageError
from gpt2_port.generate import Generation, SamplingSettings, generate_full
from gpt2_port.generate.sampling import process_logits, seen_tokens
from gpt2_port.io import adapter
from gpt2_port.io.tokenizer import EOT_ID, load_tokenizer
from gpt2_port.model import GPT2

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

# A tiny model whose random weights are large enough that greedy text keeps changing (GPT-2's 0.02 init, untrained,
# repeats one token forever, which would make equality tests weak). Context 256 so 200 new tokens fit.
CHAOTIC = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=256)
HEADS = greedy_heads()
PROMPTS = [[464, 2444, 4721, 511, 3835], [15496, 11, 995], [36235, 39141, 373, 257, 1049, 290, 262, 717, 11]]
# Token sequences from paths whose arithmetic differs (transformers' generate, another batch shape, no cache, another
# dtype) are compared under conftest.same_tokens_where_decided: each step's scores within these fractions of their
# largest |score|, and the tokens equal wherever the scores decide them. Worst seen on this CPU, in the default and
# the second test configuration: float32 2.4e-6 and 2.8e-6, float16 3.4e-3 and 3.1e-3, bfloat16 3.4e-2 and 3.2e-2.
SCORES_F32 = 2e-5
SCORES_HALF = {torch.float16: 2e-2, torch.bfloat16: 2e-1}


def _chaotic(seed: int = 1) -> GPT2:
    return chaotic_model(CHAOTIC, seed)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models spend their time in thread hand-offs, not arithmetic: one thread is several times faster (and far
    more so when other processes share the cores). Decoding 124M is bound by memory bandwidth, so it loses little."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model() -> GPT2:
    return _chaotic()


@pytest.fixture(scope="module")
def hf_model(model: GPT2):
    """transformers' GPT2LMHeadModel holding the same weights."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    hf_cfg = HFConfig(**{k: v for k, v in CHAOTIC.to_hf_dict().items() if k != "architectures"})
    hf = GPT2LMHeadModel(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(adapter.scratch_to_hf(model.state_dict(), CHAOTIC), strict=False)
    assert not unexpected and all(k == "lm_head.weight" or k.endswith("attn.bias") for k in missing)
    hf.tie_weights()
    assert torch.equal(hf.lm_head.weight, model.wte.weight)
    return hf


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path):
    return load_tokenizer(tokenizer_dir)


def _left_pad(prompts: list[list[int]], pad: int = 50256) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


# ------------------------------------------------------------------------------------------ equality with transformers
@pytest.mark.slow
def test_greedy_124m_equals_transformers_128_tokens(ckpt124: Path) -> None:
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(ckpt124, dtype=torch.float32).eval()
    ours = GPT2.from_pretrained(str(ckpt124))
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        ref = hf_greedy(hf, ids, None, 128)
    del hf
    assert ref.sequences.shape == (1, 5 + 128), "transformers stopped early; the comparison needs 128 new tokens"
    _same_as_transformers(ours, ids, None, 128, ref)


@pytest.mark.slow
def test_batched_last_logits_are_bit_identical_to_transformers(ckpt124: Path) -> None:
    """The head on x[:, -1:] (not contiguous) runs as transformers' does: one 2-D matmul (a 3-D F.linear would take
    bmm, which differs in the last bits for B > 1).

    Contract: bit-identity by construction, the same calls on the same shapes: our last-only head and transformers'
    logits_to_keep=1 head are one (8, C) @ (C, V) mm on the same strided rows; our full forward and transformers' are
    one (256, C) @ (C, V) mm. Last-only against full is not asserted: a GEMM over another number of rows may take
    another kernel (it does on a 16-core Xeon), so those two agree to rounding only."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(ckpt124, dtype=torch.float32).eval()
    ours = GPT2.from_pretrained(str(ckpt124))
    ids = torch.randint(0, 50257, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = hf(input_ids=ids, logits_to_keep=1).logits
        ref_full = hf(input_ids=ids).logits
        got = ours(ids, last_only=True)
        full = ours(ids)
    assert got.shape == ref.shape == (8, 1, 50257)
    assert torch.equal(got, ref)
    assert torch.equal(full, ref_full)


def _same_as_transformers(model: GPT2, ids: torch.Tensor, mask: torch.Tensor | None, n: int, ref, **kw) -> Generation:  # noqa: ANN001, ANN003
    """Our greedy generation against transformers' (`ref`, with its scores): the product's path (on this CPU the fast
    greedy head) makes the tokens of the run that keeps its scores, as the head proves; those scores lie within float32
    rounding of transformers', and the tokens are equal wherever the scores decide them."""
    fast = generate_full(model, ids, n, attention_mask=mask, **kw)
    got = generate_full(model, ids, n, attention_mask=mask, output_scores=True, **kw)
    assert fast.sequences.tolist() == got.sequences.tolist()
    T, eos = ids.shape[1], kw.get("eos_token_id", EOT_ID)
    compared = same_tokens_where_decided(
        ref.sequences[:, T:], list(ref.scores), got.sequences[:, T:], got.scores, SCORES_F32, eos=eos
    )
    assert min(compared) >= 1
    return got


def test_greedy_equals_transformers(model: GPT2, hf_model) -> None:
    ids = torch.tensor([PROMPTS[2]])
    ref = hf_greedy(hf_model, ids, None, 60)
    got = _same_as_transformers(model, ids, None, 60, ref)
    assert len(set(got.sequences[0, 9:].tolist())) > 20  # the text keeps changing: a meaningful comparison


def test_padded_batch_greedy_equals_transformers(model: GPT2, hf_model) -> None:
    """transformers derives positions from the mask as we do (cumsum - 1, pads at 0), so a left-padded batch agrees."""
    ids, mask = _left_pad(PROMPTS)
    _same_as_transformers(model, ids, mask, 40, hf_greedy(hf_model, ids, mask, 40))


def test_eos_stops_rows_like_transformers(model: GPT2, hf_model) -> None:
    """Rows end at EOS at different steps; finished rows are padded; the batch ends when all rows have ended."""
    ids, mask = _left_pad(PROMPTS)
    free = model.generate(ids, max_new_tokens=30, attention_mask=mask, eos_token_id=None)
    T = ids.shape[1]
    eos = int(free[1, T + 6])  # a token row 1 makes at step 6: call it EOS
    ref = hf_greedy(hf_model, ids, mask, 30, eos_token_id=eos, pad_token_id=0)
    g = _same_as_transformers(model, ids, mask, 30, ref, eos_token_id=eos, pad_token_id=0)
    assert g.sequences.shape == ref.sequences.shape  # the same steps: every row ended where transformers' did
    assert g.stop_reasons[1] == "eos" and g.new_ids[1][-1] == eos and len(g.new_ids[1]) <= 7
    assert g.sequences.shape[1] < T + 30 or "length" in g.stop_reasons


def test_greedy_with_a_repetition_penalty_equals_transformers(model: GPT2, hf_model) -> None:
    """The penalty counts the prompt and every token made so far (each step's seen tokens), and greedy decoding with
    it never takes the fast head, which knows no penalty: transformers' tokens, as it penalises. Rows without padding:
    transformers 5.17 (the floor) penalises a padded row's padding id too, where 5.24 leaves the padding out, as this
    port does (test_each_batch_row_equals_the_prompt_alone)."""
    ids, mask = torch.tensor([PROMPTS[0], PROMPTS[2][:5]]), None
    ref = hf_greedy(hf_model, ids, mask, 30, repetition_penalty=1.5)
    g = _same_as_transformers(model, ids, mask, 30, ref, repetition_penalty=1.5)
    assert not g.extra["fast_head"]
    plain = model.generate(ids, max_new_tokens=30, attention_mask=mask)
    assert not torch.equal(plain, g.sequences)  # the penalty changed the text: a meaningful comparison


def test_rows_that_end_are_padded_with_eos_unless_a_pad_id_is_given(model: GPT2) -> None:
    """As transformers: without pad_token_id a finished row's later positions hold its EOS."""
    ids, mask = _left_pad(PROMPTS)
    T = ids.shape[1]
    free = model.generate(ids, max_new_tokens=12, attention_mask=mask, eos_token_id=None)
    eos = int(free[1, T + 3])  # a token row 1 makes at step 3: call it EOS
    g = generate_full(model, ids, 12, attention_mask=mask, eos_token_id=eos)
    n = len(g.new_ids[1])
    assert g.stop_reasons[1] == "eos" and g.sequences.shape[1] > T + n  # another row ran on after it
    assert g.sequences[1, T + n :].tolist() == [eos] * (g.sequences.shape[1] - T - n)


def test_decode_tokens_count_every_rows_tokens(model: GPT2) -> None:
    """decode_tokens (the tokens/s the commands report): every row's tokens after the prefill's."""
    ids, mask = _left_pad(PROMPTS)
    g = generate_full(model, ids, 6, attention_mask=mask, eos_token_id=None)
    assert [len(r) for r in g.new_ids] == [6, 6, 6] and g.decode_tokens == 3 * 5


def test_min_new_tokens_holds_eos_back_like_transformers(model: GPT2, hf_model) -> None:
    """No EOS before min_new_tokens (its score -inf, in the scores kept too), then EOS ends rows as before: the tokens
    and scores of transformers' generate(min_new_tokens=...)."""
    ids, mask = _left_pad(PROMPTS)
    T = ids.shape[1]
    free = model.generate(ids, max_new_tokens=30, attention_mask=mask, eos_token_id=None)
    eos = int(free[1, T + 2])  # a token row 1 makes at step 2: call it EOS
    kw = dict(eos_token_id=eos, pad_token_id=0)
    early = generate_full(model, ids, 30, attention_mask=mask, **kw)
    assert early.stop_reasons[1] == "eos" and len(early.new_ids[1]) <= 3
    ref = hf_greedy(hf_model, ids, mask, 30, min_new_tokens=8, **kw)
    g = _same_as_transformers(model, ids, mask, 30, ref, min_new_tokens=8, **kw)
    assert g.sequences.shape == ref.sequences.shape
    assert all(eos not in row[:8] for row in g.new_ids) and all(len(row) >= 8 for row in g.new_ids)
    assert all(bool(s[:, eos].eq(-float("inf")).all()) for s in g.scores[:8]) and bool(
        g.scores[8][:, eos].isfinite().all()
    )


def test_processed_distributions_equal_transformers(hf_model) -> None:
    """Temperature, top-k, top-p and repetition penalty give transformers' distributions (its processors, its order),
    and the options left out default as in transformers (top-k 50 when sampling)."""
    from transformers import LogitsProcessorList

    torch.manual_seed(0)
    B, V = 3, CHAOTIC.vocab_size
    scores = torch.randn(B, V) * 3
    scores[0, :5] = scores[0, 5]  # ties at the top-k / top-p borders
    input_ids = torch.randint(0, V, (B, 12))
    input_ids[1, :6] = input_ids[1, 6:]  # repeated tokens are penalised once
    cases = [
        dict(do_sample=True, temperature=0.7),
        dict(do_sample=True, top_k=50),
        dict(do_sample=True, top_p=0.9),
        dict(do_sample=True, top_k=1),
        dict(do_sample=True, top_p=0.05),
        dict(do_sample=False, repetition_penalty=1.3),
        dict(do_sample=True, repetition_penalty=0.8),
        dict(do_sample=True, temperature=1.3, top_k=200, top_p=0.8, repetition_penalty=1.2),
        dict(do_sample=True, temperature=0.5, top_k=0, top_p=1.0),
    ]
    # uniform scores: top-p 0.5 reaches its border exactly (the tokens up to it kept, not one more); a top-p below
    # every token's share keeps the most likely one (transformers' min_tokens_to_keep)
    flat = torch.full((B, V), -float("inf"))
    flat[:, :4] = 0.0  # four tokens of 1/4 each: cumulative shares 0.25, 0.5, 0.75, 1 exactly
    more = [(dict(do_sample=True, top_k=0, top_p=0.5), flat), (dict(do_sample=True, top_k=0, top_p=1e-9), scores)]
    for c, sc in [(c, scores) for c in cases] + more:
        # what hf.generate(**c) runs with, its defaults filled in (top-k 50 when sampling), as ours are
        gc = hf_model._prepare_generation_config(None, **c, eos_token_id=50256, pad_token_id=50256)[0]
        procs = hf_model._get_logits_processor(
            generation_config=gc, input_ids_seq_length=12, logits_processor=LogitsProcessorList(), device="cpu"
        )
        ref = torch.softmax(procs(input_ids, sc.clone()), dim=-1)
        s = SamplingSettings(**c)
        got = torch.softmax(process_logits(sc.clone(), seen_tokens(input_ids, V), s), dim=-1)
        assert len(procs) > 0, c
        assert torch.equal((got > 0), (ref > 0)), c  # the same tokens are kept
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9, msg=f"{c}")
    assert int((got > 0).sum()) == B  # top-p 1e-9: one token a row


def test_a_draw_is_torch_multinomials_draw() -> None:
    """sampling.draw makes multinomial's one-sample draw without its host-side checks: the same token for every row
    and the same generator state after, over shapes, temperatures and top-k masks (zero probabilities)."""
    from gpt2_port.generate.sampling import draw

    for case in range(60):
        g = torch.Generator().manual_seed(case)
        B, V = 1 + case % 5, 7 + 97 * case
        scores = torch.randn(B, V, generator=g) * (0.2 + case % 4)
        if case % 3 == 0:
            scores[:, torch.randperm(V, generator=g)[: V // 2]] = -float("inf")  # top-k / top-p's masked tokens
        probs = torch.softmax(scores, dim=-1)
        ga, gb = torch.Generator().manual_seed(100 + case), torch.Generator().manual_seed(100 + case)
        for _ in range(3):
            assert torch.equal(draw(probs, ga), torch.multinomial(probs, 1, generator=gb).squeeze(1)), case
        assert torch.equal(ga.get_state(), gb.get_state())


# ------------------------------------------------------------------------------------------ our own invariants
def _same_where_decided(a: Generation, b: Generation, tol: float = SCORES_F32, noise=None) -> list[int]:  # noqa: ANN001
    """Two of our generations (with scores) from paths that round differently: conftest.same_tokens_where_decided."""
    new_a, new_b = a.sequences[:, a.prompt_len :], b.sequences[:, b.prompt_len :]
    compared = same_tokens_where_decided(new_a, a.scores, new_b, b.scores, tol, noise)
    assert min(compared) >= 1
    return compared


def test_kv_cache_equals_full_recomputation_200_tokens(model: GPT2) -> None:
    """The cached steps attend over (1, k) queries where recomputation runs the whole prefix: other shapes, so the
    same tokens wherever the scores decide them (conftest.same_tokens_where_decided)."""
    ids = torch.tensor([PROMPTS[0]])
    cached = generate_full(model, ids, 200, eos_token_id=None, output_scores=True)
    full = generate_full(model, ids, 200, eos_token_id=None, use_cache=False, output_scores=True)
    assert cached.sequences.shape == (1, 205)
    assert len(set(cached.sequences[0, 5:].tolist())) > 50
    _same_where_decided(cached, full)
    assert model.generate(ids, max_new_tokens=200, eos_token_id=None).tolist() == cached.sequences.tolist()  # fast head


def test_output_scores_are_the_processed_logits_each_token_was_chosen_from(model: GPT2) -> None:
    ids = torch.tensor([PROMPTS[0]])
    opts = dict(eos_token_id=None, do_sample=True, temperature=0.5, top_k=0, seed=2)
    g = generate_full(model, ids, 6, output_scores=True, **opts)
    assert g.sequences.tolist() == generate_full(model, ids, 6, **opts).sequences.tolist()  # keeping them changes none
    assert [(s.shape, s.dtype) for s in g.scores] == [((1, CHAOTIC.vocab_size), torch.float32)] * 6
    with torch.no_grad():
        logits = model(g.sequences)[0, 4:-1]  # (6, V): the forward over the whole sequence, at each step's position
    torch.testing.assert_close(torch.cat(g.scores), logits / 0.5, rtol=SCORES_F32, atol=SCORES_F32 * 30)
    assert generate_full(model, ids, 2).scores is None


@pytest.mark.parametrize("options", [dict(), dict(repetition_penalty=1.5)], ids=["greedy", "greedy+penalty"])
def test_each_batch_row_equals_the_prompt_alone(model: GPT2, options: dict) -> None:
    """A row in a padded batch and the prompt alone run other shapes: the same tokens wherever the scores decide."""
    ids, mask = _left_pad(PROMPTS)
    batch = generate_full(model, ids, 40, attention_mask=mask, eos_token_id=None, output_scores=True, **options)
    T = ids.shape[1]
    for r, p in enumerate(PROMPTS):
        alone = generate_full(model, torch.tensor([p]), 40, eos_token_id=None, output_scores=True, **options)
        row = [s[r : r + 1] for s in batch.scores]
        n = same_tokens_where_decided(
            batch.sequences[r : r + 1, T:], row, alone.sequences[:, len(p) :], alone.scores, SCORES_F32
        )
        assert n[0] >= 1, r
        assert batch.new_ids[r] == batch.sequences[r, T:].tolist()


def test_padded_batch_without_cache_equals_cache(model: GPT2) -> None:
    ids, mask = _left_pad(PROMPTS)
    a = generate_full(model, ids, 25, attention_mask=mask, eos_token_id=None, output_scores=True)
    b = generate_full(model, ids, 25, attention_mask=mask, eos_token_id=None, use_cache=False, output_scores=True)
    _same_where_decided(a, b)


def test_seed_repeats_and_samples_differ(model: GPT2) -> None:
    ids = torch.tensor([PROMPTS[0]])
    kw = dict(max_new_tokens=20, do_sample=True, temperature=1.0, top_k=100, eos_token_id=None)
    a = model.generate(ids, seed=7, **kw)
    b = model.generate(ids, seed=7, **kw)
    c = model.generate(ids, seed=8, **kw)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()
    # several samples per prompt: repeated rows, each prompt's samples together, different draws
    ids2, mask2 = _left_pad(PROMPTS[:2])
    s = model.generate(ids2, attention_mask=mask2, num_return_sequences=3, seed=1, **kw)
    assert s.shape == (6, ids2.shape[1] + 20)
    assert all(s[r, : ids2.shape[1]].tolist() == ids2[r // 3].tolist() for r in range(6))
    assert len({tuple(s[r].tolist()) for r in range(3)}) == 3
    assert model.generate(ids2, attention_mask=mask2, num_return_sequences=3, seed=1, **kw).tolist() == s.tolist()


def test_top_k_1_sampling_is_greedy(model: GPT2) -> None:
    ids = torch.tensor([PROMPTS[1]])
    greedy = model.generate(ids, max_new_tokens=15, eos_token_id=None)
    sampled = model.generate(ids, max_new_tokens=15, eos_token_id=None, do_sample=True, top_k=1, seed=3)
    assert greedy.tolist() == sampled.tolist()


def test_stop_strings_and_streaming(model: GPT2, tok) -> None:
    ids = torch.tensor([PROMPTS[0]])
    pieces: list[tuple[int, str]] = []
    free = generate_full(model, ids, 40, eos_token_id=None, tokenizer=tok, on_text=lambda r, t: pieces.append((r, t)))
    assert free.texts == [tok.decode(free.new_ids[0])]
    assert "".join(t for _, t in pieces) == free.texts[0] and len(pieces) > 5  # streamed piece by piece
    text = free.texts[0]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    pieces.clear()
    g = generate_full(
        model,
        ids,
        40,
        eos_token_id=None,
        tokenizer=tok,
        stop_strings=[stop],
        on_text=lambda r, t: pieces.append((r, t)),
    )
    cut = text.index(stop) + len(stop)
    assert g.stop_reasons == ["stop"]
    assert g.texts == [text[:cut]] == ["".join(t for _, t in pieces)]
    assert g.new_ids[0] == free.new_ids[0][: len(g.new_ids[0])]  # the same tokens, up to the one completing STR
    assert len(tok.decode(g.new_ids[0])) >= cut > len(tok.decode(g.new_ids[0][:-1]))


def test_the_stop_string_that_comes_first_ends_the_row_and_an_eos_flushes_a_begun_character(tok) -> None:
    """The host's side of each row: two stop strings completed by one token cut the text at the first one found; a
    stop string spanning tokens is found when a shorter one is set too; a row ending at EOS still emits the bytes of
    a character its last token began (the text is the decode of its tokens, streamed whole)."""
    from gpt2_port.generate.stopping import Rows

    def run(ids: list[int], stops: list[str], eos: int | None = None) -> tuple[Rows, list[str]]:
        streamed: list[str] = []
        rows = Rows(1, torch.device("cpu"), eos, stops, tok, lambda r, t: streamed.append(t))
        for t in ids:
            if rows.any_running:
                rows.accept([t])
        rows.close(context_limited=False)
        return rows, streamed

    rows, streamed = run(tok.encode(" hello"), ["llo", "he"])
    assert rows.texts == [" he"] == ["".join(streamed)] and rows.reasons == ["stop"]
    rows, _ = run(tok.encode(" hello world again"), ["lo wo", "x"])
    assert rows.texts == [" hello wo"] and rows.reasons == ["stop"]
    emoji = tok.encode("ok \U0001f600")
    ids = [*emoji[:-1], EOT_ID]  # the emoji's last byte never comes
    assert tok.decode(emoji[:-1]).endswith("\ufffd")
    rows, streamed = run(ids, [], eos=EOT_ID)
    assert rows.reasons == ["eos"] and rows.texts == [tok.decode(emoji[:-1])] == ["".join(streamed)]


def test_a_row_ended_by_a_stop_string_is_padded_while_the_others_run(model: GPT2, tok) -> None:
    """A stop string is found on the host: the row's later positions hold padding from the very next token (the loop
    reads each step before queueing the next when stop strings are set), and the other row runs on unchanged."""
    ids, mask = _left_pad(PROMPTS[:2])
    T = ids.shape[1]
    free = generate_full(model, ids, 30, attention_mask=mask, eos_token_id=None, tokenizer=tok)
    text = free.texts[0]
    stop = next(
        c for i in range(len(text) // 3, len(text) - 3) if (c := text[i : i + 3]).strip() and c not in free.texts[1]
    )
    g = generate_full(model, ids, 30, attention_mask=mask, eos_token_id=None, tokenizer=tok, stop_strings=[stop])
    assert g.stop_reasons == ["stop", "length"]
    n = len(g.new_ids[0])
    assert n < 30 and g.sequences[0, T : T + n].tolist() == g.new_ids[0] == free.new_ids[0][:n]
    assert g.sequences[0, T + n :].tolist() == [0] * (30 - n)  # padding: no EOS id given, so 0
    assert torch.equal(g.sequences[1], free.sequences[1])


def test_context_limit_stops_exactly(model: GPT2) -> None:
    n = CHAOTIC.n_positions
    g = generate_full(model, torch.tensor([PROMPTS[0]]), n, eos_token_id=None)
    assert g.context_limited and g.stop_reasons == ["context"]
    assert g.sequences.shape == (1, n)
    with pytest.raises(UsageError, match="context"):
        model.generate(torch.zeros(1, n, dtype=torch.long), max_new_tokens=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_generate(model: GPT2, dtype: torch.dtype) -> None:
    """The same model in a half dtype: its scores within that dtype's rounding of float32's, and the same tokens
    wherever that decides them."""
    m = _chaotic().to(dtype)
    ids = torch.tensor([PROMPTS[0]])
    out = generate_full(m, ids, 8, eos_token_id=None, output_scores=True)
    assert out.sequences.shape == (1, 13) and int(out.sequences.max()) < CHAOTIC.vocab_size
    ref = generate_full(model, ids, 8, eos_token_id=None, output_scores=True)
    _same_where_decided(ref, out, SCORES_HALF[dtype])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty prompt"),
        (dict(input_ids=torch.tensor([[1, 50257]])), "out of range"),
        (dict(input_ids=torch.tensor([[-1, 5]])), "out of range"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, temperature=-1.0), "temperature"),
        (dict(do_sample=True, top_p=0.0), "top_p"),
        (dict(do_sample=True, top_p=1.5), "top_p"),
        (dict(do_sample=True, top_k=-1), "top_k"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(attention_mask=torch.tensor([[1, 0, 1]])), "left-padded"),
        (dict(attention_mask=torch.tensor([[0, 0, 0]])), "empty prompt"),
    ],
)
def test_bad_arguments(model: GPT2, kwargs: dict, match: str) -> None:
    args = dict(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4) | kwargs
    with pytest.raises(UsageError, match=match):
        model.generate(**args)


# ------------------------------------------------------------------------------------------ real weights
def test_real_gpt2_the_dog() -> None:
    """transformers' own test (test_modeling_gpt2): greedy 'The dog', max_length=20, on openai-community/gpt2."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache("openai-community/gpt2", "model.safetensors")
    if not isinstance(found, str):
        pytest.skip(
            "NOT RUN: the real openai-community/gpt2 weights are not in the Hugging Face cache "
            "(download them once with network access to run this test)"
        )
    ours = GPT2.from_pretrained(str(Path(found).parent))
    out = ours.generate(torch.tensor([[464, 3290]]), max_new_tokens=18)
    assert out[0].tolist() == [
        464,
        3290,
        373,
        1043,
        287,
        257,
        2214,
        1474,
        262,
        16246,
        286,
        2688,
        290,
        2688,
        27262,
        13,
        198,
        198,
        464,
        3290,
    ]


# ------------------------------------------------------------------------------------------ the CLI
def test_cli_streams_and_writes_json(
    tiny_official: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[str] = []
    real_write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: writes.append(s) or real_write(s))
    out_json = tmp_path / "g.json"
    rc = main(
        [
            "generate",
            str(tiny_official),
            "The students opened their books",
            "--greedy",
            "--max-new-tokens",
            "12",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    cap = capsys.readouterr()
    data = json.loads(out_json.read_text())
    assert data["prompt_ids"] == [464, 2444, 4721, 511, 3835]
    assert len(data["generated_ids"]) == 1 and len(data["generated_ids"][0]) == 12
    model = GPT2.from_pretrained(str(tiny_official))
    ref = model.generate(torch.tensor([data["prompt_ids"]]), max_new_tokens=12)
    assert data["generated_ids"][0] == ref[0, 5:].tolist()
    tok = load_tokenizer(tiny_official)
    assert data["texts"] == [tok.decode(data["generated_ids"][0])]
    assert cap.out == "The students opened their books" + data["texts"][0] + "\n"
    assert len([w for w in writes if w]) >= 3  # the prompt, then the text as it came
    for k in ("load_s", "prefill_s", "decode_tok_per_s", "peak_rss_mb"):
        assert isinstance(data[k], float) and data[k] >= 0, k
    assert data["peak_rss_mb"] > 50
    assert "prefill" in cap.err and "tok/s" in cap.err and "peak RSS" in cap.err and "load" in cap.err


def test_cli_samples_seed_and_stop(tiny_official: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "generate",
        str(tiny_official),
        "Hello",
        "--max-new-tokens",
        "10",
        "--seed",
        "3",
        "--num-samples",
        "2",
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
    ]
    assert main(args + ["--json", str(tmp_path / "a.json")]) == 0
    assert main(args + ["--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["generated_ids"] == b["generated_ids"] and len(a["generated_ids"]) == 2
    out = capsys.readouterr().out
    assert "sample 1/2" in out and "sample 2/2" in out
    stop = a["texts"][0][2:5]
    assert main(args + ["--stop", stop, "--json", str(tmp_path / "c.json")]) == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["texts"][0].endswith(stop) and c["stop_reasons"][0] == "stop"


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--max-new-tokens", "-2"], "--max-new-tokens"),
        (["--temperature", "0"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "-1"], "--top-k"),
        (["--greedy", "--temperature", "0.5"], "--greedy"),
        (["--device", "tpu"], "device"),
        (["--dtype", "float8"], "dtype"),
        (["--json", "/nonexistent-dir/x.json"], "--json"),
    ],
)
def test_cli_bad_arguments(
    tiny_official: Path, capsys: pytest.CaptureFixture[str], extra: list[str], match: str
) -> None:
    assert main(["generate", str(tiny_official), "Hi", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_cli_prompt_errors(tiny_official: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_official), ""]) == 2
    assert "PROMPT is empty" in capsys.readouterr().err
    assert main(["generate", str(tiny_official), " hello" * 200]) == 2  # 400 tokens > the tiny context of 128
    err = capsys.readouterr().err
    assert "context" in err and "128" in err


def test_fused_qkv_view_is_bit_exact(tiny_official: Path) -> None:
    """An official checkpoint's q/k/v load as views of one c_attn, used as one matmul (as the reference computes it)."""
    from gpt2_port.model.c_attn import fused_qkv

    m = GPT2.from_pretrained(str(tiny_official))
    a = m.h[0].attn
    assert fused_qkv(a.q_proj, a.k_proj, a.v_proj) is not None
    ids = torch.tensor([PROMPTS[2]])
    with torch.inference_mode():
        fused = m(ids)
        for b in m.h:  # separate copies: the three-matmul path
            for lin in (b.attn.q_proj, b.attn.k_proj, b.attn.v_proj):
                lin.weight = torch.nn.Parameter(lin.weight.contiguous(), requires_grad=False)
        assert fused_qkv(m.h[0].attn.q_proj, m.h[0].attn.k_proj, m.h[0].attn.v_proj) is None
        separate = m(ids)
    torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-5)  # bit-equal with MKL; BLAS may order sums


def _fast_equals_exact(model: GPT2, kind: type, ids: torch.Tensor, mask: torch.Tensor, most: int) -> Generation:
    """60 greedy tokens through the fast head of `kind` and through the exact logits: the same tokens, with fewer
    than `most` steps left to the exact logits. Returns the exact run."""
    fast = generate_full(model, ids, 60, attention_mask=mask, eos_token_id=None)
    exact = generate_full(model, ids, 60, attention_mask=mask, eos_token_id=None, fast_head=False)
    assert fast.extra["fast_head_kind"] == kind.__name__ and exact.extra["fast_head_kind"] is None
    assert fast.sequences.tolist() == exact.sequences.tolist()
    assert fast.extra["exact_head_steps"] < most
    return exact


@pytest.mark.parametrize("kind", HEADS)
def test_fast_greedy_head_gives_the_exact_argmax(model: GPT2, monkeypatch: pytest.MonkeyPatch, kind: type) -> None:
    """Each shortcut picks the same tokens as the exact logits; with no margin it falls back."""
    from gpt2_port.generate.greedy_head import FastGreedyHead

    monkeypatch.setattr(FastGreedyHead, "make", staticmethod(kind))
    monkeypatch.delitem(model.__dict__, "_fast_greedy_head", raising=False)  # the kind an earlier test kept
    ids, mask = _left_pad(PROMPTS)
    exact = _fast_equals_exact(model, kind, ids, mask, most=60)
    h = torch.randn(4, CHAOTIC.n_embd, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kind(model.head_weight).argmax(h), torch.argmax(model.head(h), dim=-1))  # wide margins here
    monkeypatch.setattr(kind, "argmax", lambda self, h: None)  # never provable: always the exact logits
    forced = generate_full(model, ids, 60, attention_mask=mask, eos_token_id=None)
    assert forced.extra["exact_head_steps"] == 60 and forced.sequences.tolist() == exact.sequences.tolist()
    model.__dict__.pop("_fast_greedy_head")


@pytest.mark.parametrize("kind", [p for p in HEADS if p.id == "screened"])
def test_float16_greedy_goes_through_the_screen_with_the_exact_tokens(kind: type) -> None:
    """A float16 model on the CPU decodes greedily through the screened head (where oneDNN has packed bf16 kernels):
    the same tokens as its float16 logits give, with the head's work done by the screen; bf16 keeps its exact head,
    and the transposed head takes float32 weights only."""
    from gpt2_port.generate.greedy_head import FastGreedyHead, TransposedHead

    m = _chaotic().half()
    _fast_equals_exact(m, kind, *_left_pad(PROMPTS), most=30)  # the screen decides most steps
    assert not FastGreedyHead.usable(_chaotic().to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32 weight"):
        TransposedHead(m.head_weight)


def test_fast_greedy_head_is_cached_and_follows_the_weight(tiny_official: Path) -> None:
    """The shortcut's copy is made once per model, and rebuilt when the head weight changes."""
    from gpt2_port.generate.greedy_head import FastGreedyHead, ScreenedHead, TransposedHead

    m = GPT2.from_pretrained(str(tiny_official))
    first = FastGreedyHead.for_model(m)
    assert type(first) is (ScreenedHead if ScreenedHead.available() else TransposedHead)
    assert FastGreedyHead.for_model(m) is first
    with torch.no_grad():
        m.wte.weight.mul_(2.0)  # in place: the copy is stale
    second = FastGreedyHead.for_model(m)
    assert second is not first
    h = torch.randn(3, m.config.n_embd, generator=torch.Generator().manual_seed(0)) * 10  # clear leads (seeded)
    assert torch.equal(second.argmax(h), torch.argmax(m.head(h), dim=-1))  # the new weight's tokens


# ------------------------------------------------------------------------------------------ non-finite values
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_nan_weight_stops_generate_naming_step_and_tensor(sample: bool) -> None:
    """NaN in one weight makes every logit NaN: generate stops at the first step, naming the tensor (greedy would
    otherwise pick token 0 forever, and sampling fail inside torch.multinomial)."""
    m = _chaotic()
    with torch.no_grad():
        m.h[0].mlp.c_fc.weight[3, 5] = float("nan")
    kw = dict(do_sample=True, top_k=20, seed=1) if sample else {}
    with pytest.raises(UsageError) as e:
        generate_full(m, torch.tensor([PROMPTS[0]]), 10, eos_token_id=None, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("generate: the logits of step 1 (new token 1) hold NaN or Inf; non-finite weights: ")
    assert msg.endswith("h.0.mlp.c_fc.weight (expected finite values; check the checkpoint)")


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_a_greedy_choice_runs_no_fill_of_the_nonfinite_logits(sample: bool) -> None:
    """Choosing a token on the device: greedy takes the argmax of the head's logits as they are (the finite flag
    beside it; an argmax over NaN is some token, which the loop never uses), a sampled choice first puts harmless
    scores where they are not finite (a NaN distribution would make an arbitrary draw): two kernels a token fewer
    for greedy."""
    from conftest import OpNames

    from gpt2_port.generate.choose import NextToken

    m = _chaotic()
    settings = SamplingSettings.from_options({"do_sample": sample, "top_k": 0} if sample else {})
    choose = NextToken(m, settings, None, torch.Generator().manual_seed(0), fast_head=False)
    h = torch.randn(2, 1, m.config.n_embd)
    with torch.no_grad(), OpNames() as ops:
        tok, status = choose(h)
    assert tok.shape == (2,) and status.dtype in (torch.bool, torch.long)
    # the finite check is one reduction (devices.all_finite): the logits' for both, the distribution's when sampled
    assert ops.seen.count("linalg_vector_norm") == (2 if sample else 1), ops.seen
    assert ops.seen.count("masked_fill") == (1 if sample else 0), ops.seen
    if not sample:
        assert torch.equal(tok, torch.argmax(m.head(h)[:, -1].float(), dim=-1))


@pytest.mark.parametrize("how", ["greedy", "penalty", "scores", "sampled"])
def test_a_plain_greedy_choice_takes_the_argmax_of_the_logits_as_the_head_makes_them(how: str) -> None:
    """A bf16 model's greedy choice, with nothing to process or keep, is the argmax of the head's bf16 logits: no
    float32 copy of the (B, V) logits is made (a kernel a token on a GPU), and the token is the float32 logits'
    argmax (the cast is exact: the same order, the same ties), min_new_tokens' EOS fill included. A repetition
    penalty, kept scores or sampling take the float32 logits, as transformers' processors do."""
    from conftest import OpNames

    from gpt2_port.generate.choose import NextToken

    m = _chaotic().to(torch.bfloat16)
    opts = {"sampled": {"do_sample": True, "top_k": 0}, "penalty": {"repetition_penalty": 1.3}}.get(how, {})
    settings = SamplingSettings.from_options(opts)
    seen = torch.zeros(2, m.config.vocab_size, dtype=torch.bool) if how == "penalty" else None
    record = [] if how == "scores" else None
    h = torch.randn(2, 1, m.config.n_embd, dtype=torch.bfloat16)
    ref = m.head(h)[:, -1].float()
    top = int(ref[0].argmax())
    for hold in (None, (top, 1)):  # the second: that token is EOS and may not come yet
        choose = NextToken(m, settings, seen, torch.Generator().manual_seed(0), False, record, hold)
        with torch.no_grad(), OpNames() as ops:
            tok, _ = choose(h)
        casts = ops.seen.count("_to_copy")
        assert casts == (0 if how == "greedy" else 1), ops.seen
        if how in ("greedy", "scores"):
            want = ref.clone()
            if hold is not None:
                want[:, top] = -float("inf")
            assert torch.equal(tok, want.argmax(dim=-1))
            assert hold is None or int(tok[0]) != top


def test_a_token_is_written_into_the_sequence_by_its_choice_with_no_copy() -> None:
    """The loop's own kernels a token, counted over the tokens between two generation lengths (a static greedy run
    with no EOS): the chosen ids (finished rows padded) are written by their `where` straight into the sequence's
    column, so the only copy a token is the next step's input (StaticKVCache.feed); and the step makes no mask."""
    from collections import Counter

    from conftest import OpNames

    m = _chaotic()
    ids = torch.tensor([[5, 17, 42], [7, 8, 9]])
    counts = []
    for n in (6, 11):
        with OpNames() as ops:
            g = generate_full(m, ids, n, eos_token_id=None, static_cache=True, fast_head=False)
        counts.append(Counter(ops.seen))
        assert g.sequences.shape == (2, 3 + n)
    per_token = {k: (counts[1][k] - counts[0][k]) / 5 for k in counts[1] if counts[1][k] != counts[0][k]}
    assert per_token["where"] == 1 and per_token["copy_"] == 1, per_token
    assert not {"zeros", "masked_fill_", "bitwise_not"} & set(per_token), per_token
    plain = generate_full(m, ids, 11, eos_token_id=None, static_cache=False, fast_head=False)
    assert torch.equal(g.sequences, plain.sequences)


def test_nonfinite_logits_name_the_first_bad_step() -> None:
    """A NaN in the position embedding of position 5 spoils the logits from the step that reads it: the 4th new
    token after a 3-token prompt; the steps before are made."""
    m = _chaotic()
    with torch.no_grad():
        m.wpe.weight[5, 0] = float("nan")
    with pytest.raises(UsageError, match=r"logits of step 4 \(new token 4\) hold NaN or Inf; non-finite weights: wpe"):
        generate_full(m, torch.tensor([PROMPTS[1]]), 10, eos_token_id=None)


def test_inf_in_the_head_weight_stops_generate() -> None:
    m = _chaotic()
    with torch.no_grad():
        m.wte.weight[7, 0] = float("inf")  # token 7 is not in the prompt: only its logit is touched
    with pytest.raises(UsageError, match=r"step 1 .*non-finite weights: wte.weight"):
        generate_full(m, torch.tensor([PROMPTS[0]]), 5, eos_token_id=None)


@pytest.mark.parametrize("kind", HEADS)
def test_fast_greedy_head_declines_overflowing_logits(kind: type) -> None:
    """Finite weights and hidden state, one logit overflowing to +Inf: no fast answer, whatever its margin (the
    exact logits are then computed, and generate checks them). NaN and Inf in h or the weight: no answer either."""
    w = torch.randn(10, 8) * 0.1
    w[0, :2] = 2e38  # finite
    h = torch.tensor([[1.0, 1.0] + [0.0] * 6])
    assert bool(torch.isinf(h @ w.t()).any()) and bool(torch.isfinite(w).all())
    assert kind(w).argmax(h) is None
    w2 = torch.randn(10, 8)
    assert kind(w2).argmax(torch.tensor([[float("nan"), 1.0] + [0.0] * 6])) is None
    w2[3, 1] = float("inf")
    assert kind(w2).argmax(torch.tensor([[0.0, 1.0] + [0.0] * 6])) is None


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_overflow_with_finite_weights_is_named_as_such(sample: bool) -> None:
    m = _chaotic()
    with torch.no_grad():
        m.ln_f.weight.fill_(3e38)  # finite, but ln_f (and so the logits) overflow float32
    kw = dict(do_sample=True, seed=1) if sample else {}
    with pytest.raises(
        UsageError, match=r"step 1 .*the weights are all finite, so an activation overflowed in float32"
    ):
        generate_full(m, torch.tensor([PROMPTS[0]]), 5, eos_token_id=None, **kw)


@pytest.mark.parametrize("opts", [dict(temperature=1e-40), dict(repetition_penalty=1e-40)], ids=["temp", "penalty"])
def test_sampling_settings_that_overflow_finite_logits_stop_generate(opts: dict) -> None:
    """Finite logits divided by a tiny temperature (or, for seen tokens, a tiny penalty) overflow to +-Inf, and their
    softmax is NaN: generate stops at that step, naming the settings (transformers' multinomial raises there), rather
    than drawing token 0 from NaN probabilities."""
    m = _chaotic()
    name = next(iter(opts))
    with pytest.raises(UsageError, match=rf"^generate: step 1 \(new token 1\): {name} 1e-40 turn finite logits into"):
        generate_full(m, torch.tensor([PROMPTS[0]]), 5, eos_token_id=None, do_sample=True, seed=1, **opts)
    ok = generate_full(m, torch.tensor([PROMPTS[0]]), 5, eos_token_id=None, do_sample=True, seed=1, temperature=1e-3)
    assert ok.sequences.shape[1] == len(PROMPTS[0]) + 5  # a small temperature that does not overflow still samples


def test_cli_nan_weight_prints_no_text_and_exits_2(
    tiny_official: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from gpt2_port.io.safetensors_io import SafetensorsFile, write_safetensors

    d = tmp_path / "nan"
    shutil.copytree(tiny_official, d)
    st = SafetensorsFile(d / "model.safetensors")
    tensors = {k: st.get(k).clone() for k in st.keys()}
    del st
    tensors["h.1.attn.c_proj.weight"][0, 0] = float("nan")
    write_safetensors(
        d / "model.safetensors",
        [(k, tuple(t.shape), t.dtype, lambda t=t: t) for k, t in sorted(tensors.items())],
        metadata={"format": "pt"},
    )
    assert main(["generate", str(d), "Hello there", "--max-new-tokens", "5"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "logits of step 1 (new token 1) hold NaN or Inf; non-finite weights: h.1.attn.c_proj.weight" in err


def test_options_of_numpy_types_are_taken_and_of_wrong_types_named(model: GPT2) -> None:
    """numpy's numbers (as a script that computes them passes them) are taken; a bool top_k, a string temperature or
    a list of EOS ids is a one-line UsageError naming the option, not a TypeError from inside torch."""
    import numpy as np

    ids = torch.tensor([PROMPTS[0]])
    opts = dict(do_sample=True, seed=1, eos_token_id=None)
    a = generate_full(model, ids, np.int64(4), temperature=np.float32(0.5), top_k=np.int32(5), **opts).sequences
    assert torch.equal(a, generate_full(model, ids, 4, temperature=0.5, top_k=5, **opts).sequences)
    bad = [
        (dict(top_k=True), r"top_k must be an integer, got True \(bool\)"),
        (dict(temperature="hot"), r"temperature must be a number, got 'hot' \(str\)"),
        (dict(eos_token_id=[50256, 1]), r"eos_token_id must be an integer, got \[50256, 1\] \(list\)"),
    ]
    for kw, match in bad:
        with pytest.raises(UsageError, match=match):
            generate_full(model, ids, 4, **{**opts, **kw})
    mask = generate_full(model, [[0, *PROMPTS[0]]], 4, attention_mask=[[0] + [1] * len(PROMPTS[0])], **opts)
    assert torch.equal(mask.sequences[:, 1:], generate_full(model, ids, 4, **opts).sequences)  # lists taken as tensors
