"""Zero-shot evaluation: the windows (lm-eval's rolling, the strided one), the streamed text, and every score equal
to transformers on the same windows (random official-layout checkpoints; the real weights when cached)."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpt2_port.errors import UsageError
from gpt2_port.eval.jsonl import read_jsonl
from gpt2_port.eval.perplexity import evaluate_text
from gpt2_port.eval.score import NonFiniteLogits, Scorer, model_scorer, score_batch
from gpt2_port.eval.tasks import choice_requests, encode_pair, evaluate_choices, evaluate_lambada, lambada_requests
from gpt2_port.eval.windows import Request, rolling_requests, strided_requests
from gpt2_port.io.text import read_text_pieces, safe_cut
from gpt2_port.io.tokenizer import load_tokenizer
from gpt2_port.model import GPT2

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"
P = 99  # the prefix token in window tests
NLL_RTOL = 1e-6  # float32 against transformers (worst seen in these tests: 0.0 with sdpa, see test_text_nll_...)


def chunked(tokens: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for s in sizes:
        out.append(tokens[i : i + s])
        i += s
    out.append(tokens[i:])
    return out


def scored(reqs: list[Request]) -> list[int]:
    return [t for r in reqs for t in r.continuation]


# -- rolling windows ---------------------------------------------------------------------------------------------
def test_rolling_windows_match_a_hand_derived_lm_eval_example() -> None:
    # tokens 0..9, max_length 4: get_rolling_token_windows(context_len=1) then make_disjoint_window, worked by hand:
    #   window 1: P 0 1 2 -> predicts 0 1 2 3      (context [P])
    #   window 2: 3 4 5 6 -> predicts 4 5 6 7      (context [3], the token before)
    #   window 3: 5 6 7 8 -> predicts 8 9          (partial: context [5 6 7], the model still reads 4 tokens)
    reqs = list(rolling_requests([list(range(10))], P, 4))
    assert reqs == [Request([P], [0, 1, 2, 3]), Request([3], [4, 5, 6, 7]), Request([5, 6, 7], [8, 9])]
    assert [r.model_input(4) for r in reqs] == [[P, 0, 1, 2], [3, 4, 5, 6], [5, 6, 7, 8]]


def test_rolling_one_window_and_exact_multiple() -> None:
    assert list(rolling_requests([[7, 8]], P, 4)) == [Request([P], [7, 8])]
    assert list(rolling_requests([[0, 1, 2, 3, 4, 5, 6, 7]], P, 4)) == [
        Request([P], [0, 1, 2, 3]),
        Request([3], [4, 5, 6, 7]),
    ]
    assert list(rolling_requests([[]], P, 4)) == []


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
def test_rolling_scores_every_token_exactly_once_in_any_chunking(M: int) -> None:
    rng = random.Random(M)
    for n in range(0, 40):
        tokens = [rng.randrange(1000) for _ in range(n)]
        whole = list(rolling_requests([tokens], P, M))
        assert scored(whole) == tokens  # every token once, in order
        for i, r in enumerate(whole):
            x = r.model_input(M)
            assert len(x) <= M and len(r.continuation) <= M
            assert (r.context + r.continuation)[1:] == (r.context + r.continuation)[1:]
            if i > 0:  # later windows: the model reads M tokens, the context is the text just before
                assert len(x) == M
                start = sum(len(w.continuation) for w in whole[:i])
                assert r.context == tokens[start - len(r.context) : start]
        sizes = [rng.randrange(0, 7) for _ in range(5)]
        assert list(rolling_requests(chunked(tokens, sizes), P, M)) == whole


# -- strided windows ---------------------------------------------------------------------------------------------
def test_strided_windows_match_a_hand_derived_example() -> None:
    # seq = P 0 1 ... 9, max_length 4, stride 2: windows start at seq[0], seq[2], seq[4], seq[6]:
    #   reads P 0 1 2 -> scores 0 1 2 3;  reads 1 2 3 4 -> scores 4 5 (new);  reads 3 4 5 6 -> scores 6 7;
    #   reads 5 6 7 8 -> scores 8 9, and ends at the text's end.
    reqs = list(strided_requests([list(range(10))], P, 4, 2))
    assert reqs == [
        Request([P], [0, 1, 2, 3]),
        Request([1, 2, 3], [4, 5]),
        Request([3, 4, 5], [6, 7]),
        Request([5, 6, 7], [8, 9]),
    ]
    # a last window cut short by the text's end: seq = P 0..6, stride 3 -> starts 0, 3; the second reads 2 3 4 5
    assert list(strided_requests([list(range(7))], P, 4, 3)) == [Request([P], [0, 1, 2, 3]), Request([2, 3], [4, 5, 6])]


@pytest.mark.parametrize(("M", "S"), [(1, 1), (4, 1), (4, 3), (4, 4), (7, 2), (8, 5)])
def test_strided_scores_every_token_exactly_once(M: int, S: int) -> None:
    rng = random.Random(M * 10 + S)
    for n in range(0, 40):
        tokens = [rng.randrange(1000) for _ in range(n)]
        whole = list(strided_requests([tokens], P, M, S))
        assert scored(whole) == tokens
        seq = [P, *tokens]
        for k, r in enumerate(whole):
            assert r.context + r.continuation == seq[k * S : k * S + len(r.context) + len(r.continuation)]
            assert len(r.model_input(M)) <= M
            if k > 0:
                assert len(r.continuation) <= S  # only tokens no earlier window scored
        sizes = [rng.randrange(0, 7) for _ in range(5)]
        assert list(strided_requests(chunked(tokens, sizes), P, M, S)) == whole


def test_stride_equal_to_max_length_is_rolling_but_for_the_last_window() -> None:
    tokens = list(range(22))
    roll, strid = list(rolling_requests([tokens], P, 5)), list(strided_requests([tokens], P, 5, 5))
    assert roll[:-1] == strid[:-1] and roll[-1].continuation == strid[-1].continuation == [20, 21]
    assert len(roll[-1].context) == 4 and strid[-1].context == [19]  # rolling extends the context to the left


@pytest.mark.parametrize("S", [0, -1, 5])
def test_stride_outside_1_to_max_length_is_refused(S: int) -> None:
    with pytest.raises(UsageError, match="--stride"):
        list(strided_requests([[1, 2, 3]], P, 4, S))


# -- streaming the text ----------------------------------------------------------------------------------------------
def test_evaluation_cuts_its_text_with_prepares_rule() -> None:
    """One cut rule for prepare and eval (io/text.py): before a whitespace run that follows a non-space."""
    assert safe_cut("ab\ncd") == 2
    assert safe_cut("ab \ncd") == 2  # the run " \n" stays whole, after the cut
    assert safe_cut("ab\n\ncd") == 2 and safe_cut("  \n") == 0 and safe_cut("abcd") == 0
    assert safe_cut("a\nb c\nd ef") == 7


def test_streamed_pieces_encode_to_the_whole_texts_tokens(tokenizer_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(tokenizer_dir)
    text = SHAKESPEARE.read_text()[:60000]
    # awkward spots: whitespace runs around newlines, a multi-byte character cut by the block, <|endoftext|>
    text += "x \nY  \n\nZ\n é€😀 caf\u00e9\nnaïve<|endoftext|>\nend \t\n"
    f = tmp_path / "t.txt"
    f.write_bytes(text.encode())
    for block in (7, 64, 1000, 1 << 20):
        pieces = list(read_text_pieces(f, block=block))
        assert "".join(pieces) == text
        assert [t for p in pieces for t in tok.encode(p)] == tok.encode(text)
        if block == 1000:
            assert len(pieces) > 30  # it did stream


def test_not_utf8_names_the_byte(tmp_path: Path) -> None:
    f = tmp_path / "bad.txt"
    f.write_bytes(b"hello\nworld " * 10 + b"\xff rest")
    for block in (5, 1 << 20):
        with pytest.raises(UsageError, match=r"bad.txt: not UTF-8 text: invalid byte 0xff at byte offset 120"):
            list(read_text_pieces(f, block=block))
    f.write_bytes(b"ok \xe2\x82")  # a character cut at the end of the file
    with pytest.raises(UsageError, match="not UTF-8.*at byte offset 3"):
        list(read_text_pieces(f, block=2))


# -- scores against transformers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path):  # noqa: ANN201
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def ours(tiny_official: Path) -> GPT2:
    return GPT2.from_pretrained(tiny_official).eval()


@pytest.fixture(scope="module")
def hf(tiny_official: Path):  # noqa: ANN201
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tiny_official, attn_implementation="eager").eval()


def hf_nll(hf, reqs: list[Request], M: int) -> list[float]:  # noqa: ANN001
    """transformers' logits, one window at a time (no batching, eager attention), log-softmax and gather."""
    out = []
    with torch.no_grad():
        for r in reqs:
            x = r.model_input(M)
            logits = hf(torch.tensor([x])).logits[0].float()  # (T, V)
            logp = F.log_softmax(logits, -1)[len(x) - len(r.continuation) :]  # the scored positions
            out.append(-float(logp.gather(-1, torch.tensor(r.continuation)[:, None]).sum()))
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize(
    ("chars", "windows"),
    [(200, 1), (1500, 4), (3000, 7)],  # one window; several with a partial last one (max_length 128)
)
@pytest.mark.parametrize("stride", [None, 48])
def test_text_nll_equals_transformers_on_the_same_windows(
    chars: int, windows: int, stride: int | None, tok, ours: GPT2, hf, tmp_path: Path
) -> None:
    text = SHAKESPEARE.read_text()[:chars]
    f = tmp_path / "t.txt"
    f.write_text(text)
    M = 128
    ids = tok.encode(text)
    if stride is None:
        reqs = list(rolling_requests([ids], tok.eot_id, M))
        assert len(reqs) == windows and (len(ids) % M != 0 or windows == 1)
    else:
        reqs = list(strided_requests([ids], tok.eot_id, M, stride))
    want = hf_nll(hf, reqs, M)
    res = evaluate_text([model_scorer(ours)], tok.encode, f, M, tok.eot_id, stride, batch_size=3, block=256)
    got = res["gpt2_port"]
    assert got.tokens == len(ids) and len(got.window_nll) == len(reqs)
    for a, b in zip(got.window_nll, want):
        assert rel(a, b) <= NLL_RTOL
    assert rel(got.nll, sum(want)) <= NLL_RTOL
    assert got.bytes == len(text.encode()) and got.words == len(re.split(r"\s+", text))
    # lm-eval's formulas on the NLL just checked (the exponentials amplify its 1e-7 noise, so compare the logs)
    assert math.isclose(math.log(got.perplexity), sum(want) / len(ids), rel_tol=NLL_RTOL)
    assert math.isclose(got.bits_per_byte, sum(want) / got.bytes / math.log(2), rel_tol=NLL_RTOL)
    assert math.isclose(math.log(got.byte_perplexity), sum(want) / got.bytes, rel_tol=NLL_RTOL)
    assert math.isclose(math.log(got.word_perplexity), sum(want) / got.words, rel_tol=NLL_RTOL)


def test_batch_size_and_block_do_not_change_the_scores(tok, ours: GPT2, tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text(SHAKESPEARE.read_text()[:4000])
    runs = [
        evaluate_text([model_scorer(ours)], tok.encode, f, 100, tok.eot_id, None, batch_size=b, block=k)["gpt2_port"]
        for b, k in ((1, 1 << 20), (4, 300), (16, 50))
    ]
    for r in runs[1:]:
        assert r.tokens == runs[0].tokens and r.words == runs[0].words and r.bytes == runs[0].bytes
        assert max(rel(a, b) for a, b in zip(r.window_nll, runs[0].window_nll)) <= NLL_RTOL


def test_check_scores_with_transformers_in_the_same_batches(tiny_official: Path, tok, ours: GPT2, tmp_path) -> None:
    from gpt2_port.io.load import read_checkpoint
    from gpt2_port_checks.evaluation import compare_text, reference_scorer

    f = tmp_path / "t.txt"
    f.write_text(SHAKESPEARE.read_text()[:2500])
    _, report = read_checkpoint(tiny_official)
    ref = reference_scorer(report.checkpoint, report.config, torch.float32, torch.device("cpu"))
    eager = reference_scorer(report.checkpoint, report.config, torch.float32, torch.device("cpu"), attn="eager")
    res = evaluate_text([model_scorer(ours), ref, eager], tok.encode, f, 128, tok.eot_id)
    parity = compare_text(res["gpt2_port"], res["transformers"], "float32")
    assert parity.passed, parity.format()
    assert parity.noise_floor is None and parity.as_close_as_reference is None and "vs floor" not in parity.format()
    assert len(res["transformers"].window_nll) == len(res["gpt2_port"].window_nll) > 1
    assert rel(res["transformers"].nll, res["gpt2_port"].nll) <= NLL_RTOL
    # the floor: each row beside the same row for eager transformers against sdpa transformers
    floored = compare_text(res["gpt2_port"], res["transformers"], "float32", res["transformers (eager)"])
    total, worst = floored.rows[:2]
    per_window = [abs(a - b) for a, b in zip(res["transformers (eager)"].window_nll, res["transformers"].window_nll)]
    assert total.quantity == "total nll" and total.floor == pytest.approx(sum(per_window) / res["transformers"].nll)
    assert worst.floor == pytest.approx(max(d / b for d, b in zip(per_window, res["transformers"].window_nll)))
    assert floored.as_close_as_reference is True and all(r.within_noise for r in floored.rows), floored.format()
    # the gate can fail: a reference 1e-5 away is caught, and is above the floor (the floor is far below 1e-5 here)
    assert total.floor < 1e-6
    res["transformers"].nll *= 1 + 1e-5
    assert not compare_text(res["gpt2_port"], res["transformers"], "float32").passed
    moved = compare_text(res["gpt2_port"], res["transformers"], "float32", res["transformers (eager)"])
    assert moved.rows[0].within_noise is False and moved.as_close_as_reference is False
    assert "eager attention is: NO (" in moved.format()


def test_the_check_floors_by_hand() -> None:
    """Each row's floor on hand-made results: a total's is the sum of the items' distances (not the distance of the
    sums, which cancel), the worst item's the floor's own worst, the perplexity's exp of the spread per token, and a
    count's the floor's own disagreements; the verdicts at NOISE_MARGIN, and the sentence the parity report says."""
    from gpt2_port.eval.perplexity import TextResult
    from gpt2_port.eval.tasks import ChoiceResult, LambadaResult
    from gpt2_port_checks.evaluation import compare_choices, compare_lambada, compare_text

    ref = TextResult(tokens=10, nll=30.0, window_nll=[10.0, 20.0])
    eager = TextResult(tokens=10, nll=30.0, window_nll=[10.001, 19.999])  # signed total 0: a floor of 0 would be wrong
    ours = TextResult(tokens=10, nll=30.0015, window_nll=[10.0015, 20.0])
    p = compare_text(ours, ref, "bfloat16", eager)
    total, worst, tokens, ppl = p.rows
    assert total.floor == pytest.approx(0.002 / 30) and total.diff == pytest.approx(0.0015 / 30)
    assert worst.quantity == "worst window nll (#0)" and worst.floor == pytest.approx(1e-4)
    assert tokens.floor == 0 and tokens.noise_verdict == "within noise"
    assert ppl.floor == pytest.approx(math.expm1(0.002 / 10))
    assert total.within_noise and worst.within_noise and worst.noise_ratio == pytest.approx(1.5)
    assert p.as_close_as_reference is True and p.to_json()["rows"][0]["noise_ratio"] == pytest.approx(0.75)
    assert "eager attention is: YES (every figure within 2x the floor; worst x1.5 at worst window nll (#0))" in (
        p.format()
    )
    far = TextResult(tokens=10, nll=30.01, window_nll=[10.01, 20.0])  # 5x the total's floor
    q = compare_text(far, ref, "bfloat16", eager)
    assert q.passed and q.rows[0].noise_verdict == "above x5" and q.as_close_as_reference is False
    assert "is: NO (3 of 4 figures above the floor; first at total nll, above x5)" in q.format()
    assert compare_text(far, ref, "bfloat16").as_close_as_reference is None
    assert "is: YES (bit-exact at every figure)" in compare_text(ref, ref, "float32", eager).format()

    lam_ref = LambadaResult([1.0, 2.0, 3.0], [True, False, True])
    lam_floor = LambadaResult([1.0, 2.0, 3.0], [True, True, True])  # one verdict flips between transformers' kernels
    two = LambadaResult([1.0, 2.0, 3.0], [False, True, True])  # two flips: within 2x the floor's one, but over 0
    acc = compare_lambada(two, lam_ref, "float32", lam_floor).rows[2]
    assert (acc.diff, acc.floor, acc.within_noise, acc.passed) == (2, 1, True, False)
    exact = LambadaResult([1.0, 2.0, 3.0], [True, False, True])
    one = compare_lambada(LambadaResult([1.0, 2.0, 3.0], [True, True, True]), lam_ref, "float32", exact).rows[2]
    assert one.noise_verdict == "above (reference exact here)" and one.within_noise is False

    ch_ref = ChoiceResult([0, 1], [0, 1], [0, 0], [1.0, 2.0, 3.0, 4.0])
    ch_floor = ChoiceResult([0, 1], [0, 1], [0, 1], [1.0, 2.0, 3.0, 4.0])
    ch_ours = ChoiceResult([0, 1], [1, 1], [0, 0], [1.0, 2.0, 3.0, 4.0])
    rows = {r.quantity: r for r in compare_choices(ch_ours, ch_ref, "float32", ch_floor).rows}
    assert (rows["acc"].diff, rows["acc"].floor, rows["acc"].within_noise) == (1, 0, False)
    assert (rows["acc_norm"].diff, rows["acc_norm"].floor, rows["acc_norm"].within_noise) == (0, 1, True)


# -- LAMBADA -------------------------------------------------------------------------------------------------------
class Successor:
    """A fake model whose argmax after token t is t + 1 (logit 5 on it, 0 elsewhere): greedy is predictable."""

    V = 50

    def scorer(self) -> Scorer:
        return Scorer(
            "fake",
            lambda ids: F.one_hot(ids, self.V).float(),  # (B, T, V) "hidden states"
            lambda h: 5.0 * torch.roll(h, 1, dims=-1),  # (N, V): logit 5 on t + 1
            torch.device("cpu"),
        )


def test_a_tie_between_choices_goes_to_the_first_as_numpys_argmax_gives_it() -> None:
    from gpt2_port.eval.tasks import _argmax

    assert _argmax([1.0, 2.0, 2.0]) == 1 and _argmax([3.0, 3.0]) == 0 and _argmax([-1.0]) == 0


def test_lambada_accuracy_needs_every_target_token_to_be_the_argmax() -> None:
    s = Successor().scorer()
    reqs = [Request([5], [6, 7, 8]), Request([5], [9, 10]), Request([5], [6, 9])]
    res = evaluate_lambada([s], reqs, 16, 0, batch_size=2)["fake"]
    assert res.correct == [True, False, False]
    assert res.last_token_correct == [True, True, False]  # [9, 10]: only its last token is the argmax
    hit, miss = -math.log(math.exp(5) / (math.exp(5) + 49)), -math.log(1 / (math.exp(5) + 49))
    assert res.word_nll == pytest.approx([3 * hit, miss + hit, hit + miss], rel=1e-6)
    j = res.to_json()
    assert j["accuracy"] == pytest.approx(1 / 3) and j["n"] == 3
    assert j["perplexity"] == pytest.approx(math.exp((5 * hit + 2 * miss) / 3))  # exp(mean word NLL)


def test_lambada_and_choices_batch_longest_first_and_answer_in_file_order() -> None:
    """Batches are made longest input first (lm-eval's order: the least padding, the largest batch first); every
    result lands at its own document's or ending's place, as a batch of one gives it."""
    widths: list[int] = []
    s = Successor().scorer()
    hidden = s.hidden
    s.hidden = lambda ids: (widths.append(ids.shape[1]), hidden(ids))[1]
    reqs = [Request([5], [6]), Request([1, 2, 3, 4], [9, 10]), Request([7, 8], [9]), Request([3, 4, 5], [7])]
    one = evaluate_lambada([s], reqs, 16, 0, batch_size=1)["fake"]
    widths.clear()
    two = evaluate_lambada([s], reqs, 16, 0, batch_size=2)["fake"]
    assert widths == [5, 2]  # inputs of 5, 3 | 2, 1 tokens (in file order 1, 5 | 2, 3: widths 5, 3)
    assert (two.word_nll, two.correct, two.last_token_correct) == (one.word_nll, one.correct, one.last_token_correct)
    assert two.correct == [True, False, True, False] and two.target_tokens == 5
    q = [([reqs[0], reqs[1]], [1, 1], 0), ([reqs[2], reqs[3]], [1, 1], 1)]
    widths.clear()
    c = evaluate_choices([s], q, 16, 0, batch_size=2)["fake"]
    assert widths == [5, 2] and c.ending_nll == one.word_nll


def test_lambada_target_is_the_last_word_encoded_with_its_context(tok) -> None:
    docs = [{"text": "He looked at the sky and saw an albatross", "_line": 1}]
    (r,) = lambada_requests(docs, tok.encode, tok.eot_id, "--lambada x")
    whole = tok.encode("He looked at the sky and saw an albatross")
    assert r.context == tok.encode("He looked at the sky and saw an")
    assert r.context + r.continuation == whole and tok.decode(r.continuation) == " albatross"
    assert len(r.continuation) > 1  # a multi-token word: all of its tokens are the target
    # lm-eval splits on " " alone: a newline stays in the context, and a double space leaves one at the context's
    # end, which encode_pair moves to the target
    (r,) = lambada_requests([{"text": "He said\nhello  there", "_line": 2}], tok.encode, tok.eot_id, "--lambada x")
    assert tok.decode(r.context) == "He said\nhello" and tok.decode(r.continuation) == "  there"
    assert r.context + r.continuation == tok.encode("He said\nhello  there")


def test_encode_pair_moves_trailing_spaces_to_the_continuation(tok) -> None:
    r = encode_pair(tok.encode, tok.eot_id, "Hello ", "world")
    assert r.context == tok.encode("Hello") and r.continuation == tok.encode("Hello world")[len(r.context) :]
    assert encode_pair(tok.encode, tok.eot_id, "", " x") == Request([tok.eot_id], tok.encode(" x"))


def test_lambada_nll_and_accuracy_equal_transformers(tok, ours: GPT2, hf) -> None:
    texts = [
        "The cat sat on the mat and then the cat",
        "She opened the door, looked outside, and said goodbye",
        "x " * 200 + "final",  # longer than the window: the context is cut on the left
    ]
    reqs = lambada_requests([{"text": t, "_line": i} for i, t in enumerate(texts)], tok.encode, tok.eot_id, "-")
    res = evaluate_lambada([model_scorer(ours)], reqs, 128, tok.eot_id, batch_size=2)["gpt2_port"]
    want = hf_nll(hf, reqs, 128)
    assert all(rel(a, b) <= NLL_RTOL for a, b in zip(res.word_nll, want))
    with torch.no_grad():
        for r, correct in zip(reqs, res.correct):
            x = r.model_input(128)
            pred = hf(torch.tensor([x])).logits[0, len(x) - len(r.continuation) :].argmax(-1).tolist()
            assert correct == (pred == r.continuation)


# -- multiple choice -----------------------------------------------------------------------------------------------
def test_choices_acc_and_char_normalised_acc_equal_an_independent_computation(tok, ours: GPT2, hf) -> None:
    docs = [
        {"ctx": "A man is sitting on a roof. He", "endings": ["starts pulling up roofing.", "is", "eats"], "label": 0},
        {"ctx": "The chef", "endings": ["cooks a very long and complicated dinner tonight.", "sleeps"], "label": 1},
        {"ctx": "Birds", "endings": ["fly", "swim in the deep blue ocean all day long", "sing"], "label": 2},
    ]
    for i, d in enumerate(docs):
        d["_line"] = i + 1
    qs = choice_requests(docs, tok.encode, tok.eot_id, "-")
    res = evaluate_choices([model_scorer(ours)], qs, 128, tok.eot_id, batch_size=4)["gpt2_port"]
    acc = acc_norm = 0
    for (reqs, chars, label), d in zip(qs, docs):
        assert chars == [len(e) for e in d["endings"]]
        ll = [-x for x in hf_nll(hf, reqs, 128)]
        acc += max(range(len(ll)), key=lambda i: ll[i]) == label
        acc_norm += max(range(len(ll)), key=lambda i: ll[i] / chars[i]) == label
        for r, e in zip(reqs, d["endings"]):
            assert tok.decode(r.continuation) == " " + e
    j = res.to_json()
    assert j["acc"] == acc / 3 and j["acc_norm"] == acc_norm / 3 and j["n"] == 3


def test_choices_normalise_by_characters_not_tokens() -> None:
    # two endings: 1 token of NLL 2.0 over 10 characters (0.2/char) against 2 tokens NLL 1.0 over 2 characters
    s = Scorer("fake", lambda ids: ids[..., None].float(), lambda h: torch.zeros(len(h), 4), torch.device("cpu"))
    q = [([Request([0], [1]), Request([0], [1, 1])], [10, 2], 0)]
    res = evaluate_choices([s], q, 8, 0)["fake"]
    # uniform logits over 4: each token costs log 4; ll = -log4 and -2 log4; per char -0.139 and -0.693
    assert res.pred == [0] and res.pred_norm == [0]
    q = [([Request([0], [1, 1]), Request([0], [1])], [100, 1], 1)]
    res = evaluate_choices([s], q, 8, 0)["fake"]
    assert res.pred == [1] and res.pred_norm == [0]  # by characters the long ending wins; by sum the short


def test_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    f = tmp_path / "l.jsonl"
    f.write_text('{"text": "a b"}\n\n{"text": "c d"\n')
    with pytest.raises(UsageError, match="line 3 is not valid JSON"):
        read_jsonl(f, "--lambada", {"text": str})
    f.write_text('{"text": "a b"}\n{"txt": "c d"}\n')
    with pytest.raises(UsageError, match="line 2 has no 'text' field"):
        read_jsonl(f, "--lambada", {"text": str})
    f.write_text(json.dumps({"ctx": "a", "endings": ["x", "y"], "label": 2}) + "\n")
    docs = read_jsonl(f, "--choices", {"ctx": str, "endings": list, "label": int})
    with pytest.raises(UsageError, match="line 1: label 2 is outside the 2 endings"):
        choice_requests(docs, lambda s: [1], 0, "--choices")


# -- non-finite logits -----------------------------------------------------------------------------------------------
def test_nan_weight_stops_the_evaluation_naming_the_weight(tiny_official: Path) -> None:
    m = GPT2.from_pretrained(tiny_official)
    with torch.no_grad():
        m.h[1].mlp.c_fc.weight[3, 5] = float("nan")
    with pytest.raises(
        NonFiniteLogits, match=r"non-finite logits .* at window 7, position .* NaN/Inf in h.1.mlp.c_fc.weight"
    ):
        score_batch(model_scorer(m), [Request([1], [2, 3])], 16, 0, "window", 7)


def test_ids_outside_the_vocabulary_are_refused_before_the_model_runs() -> None:
    """On CUDA an id >= V is a device-side assert that kills the process's CUDA context: checked on the host first,
    from the lists, naming the request (a context id and a scored id alike)."""

    def never(_ids: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the model ran")

    s = Scorer("fake", never, lambda h: torch.zeros(len(h), 8), torch.device("cpu"), vocab_size=8)
    with pytest.raises(UsageError, match=r"window 4: token id 9 is outside the model's vocabulary of 8 tokens"):
        score_batch(s, [Request([1], [2, 3]), Request([1], [2, 9])], 8, 0, "window", 3)
    with pytest.raises(UsageError, match=r"choice 0: token id 12 is outside"):
        score_batch(s, [Request([12], [2])], 8, 0, "choice")
    with pytest.raises(UsageError, match=r"padding id 99 is outside the model's vocabulary of 8"):
        score_batch(s, [Request([1], [2]), Request([1, 2], [3])], 8, 99)  # the short row is padded


def test_a_batch_makes_no_host_tensor_between_the_forward_and_the_head(monkeypatch) -> None:
    """Everything the device needs for a batch goes in one copy before the forward: a tensor built from host lists
    after it (the scored rows' indices, the targets) would wait on CUDA for the whole forward before the head."""
    made: list[str] = []

    def spy(name: str, real):  # noqa: ANN001, ANN202
        def made_one(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            made.append(name)
            return real(*a, **kw)

        return made_one

    def hidden(ids: torch.Tensor) -> torch.Tensor:
        made.append("forward")
        return F.one_hot(ids, 8).float()  # (B, T, 8)

    def head(h: torch.Tensor) -> torch.Tensor:
        made.append("head")
        return h

    for name in ("tensor", "as_tensor", "from_numpy", "LongTensor"):  # the Python calls that make a host tensor
        monkeypatch.setattr(torch, name, spy(name, getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "to", spy("to", torch.Tensor.to))  # and copy one to a device
    real_index = torch.Tensor.__getitem__

    def index(self: torch.Tensor, key):  # noqa: ANN001, ANN202
        keys = key if isinstance(key, tuple) else (key,)
        if not all(isinstance(k, (torch.Tensor, slice, int, type(None), type(...))) for k in keys):
            made.append("index from a host sequence")  # torch makes a tensor of the list and copies it over
        return real_index(self, key)

    monkeypatch.setattr(torch.Tensor, "__getitem__", index)
    s = Scorer("fake", hidden, head, torch.device("cpu"), vocab_size=8)
    sums, _, _ = score_batch(s, [Request([1], [2, 3]), Request([4], [5])], 8, 0)
    assert made.index("head") == made.index("forward") + 1, made
    assert sums == pytest.approx([2 * math.log(math.e + 7), math.log(math.e + 7)])  # logit 1 on the input token


# -- the real weights ----------------------------------------------------------------------------------------------
def test_real_gpt2_rolling_nll_equals_transformers(tok, tmp_path: Path) -> None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache("openai-community/gpt2", "model.safetensors")
    if not isinstance(found, str):
        pytest.skip(
            "NOT RUN: the real openai-community/gpt2 weights are not in the Hugging Face cache "
            "(download them once with network access to run this test)"
        )
    from transformers import GPT2LMHeadModel

    d = Path(found).parent
    m = GPT2.from_pretrained(d)
    ref = GPT2LMHeadModel.from_pretrained(d, attn_implementation="eager").eval()
    text = SHAKESPEARE.read_text()[:5000]
    f = tmp_path / "t.txt"
    f.write_text(text)
    reqs = list(rolling_requests([tok.encode(text)], tok.eot_id, 512))
    got = evaluate_text([model_scorer(m)], tok.encode, f, 512, tok.eot_id)["gpt2_port"]
    want = hf_nll(ref, reqs, 512)
    assert rel(got.nll, sum(want)) <= NLL_RTOL
    assert 2.0 < got.nll / got.tokens < 5.0  # the real model: a sane per-token loss on Shakespeare


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_one_non_finite_logit_in_a_scored_row_is_caught(bad: float) -> None:
    def head(h: torch.Tensor) -> torch.Tensor:  # (N, V): finite except one logit of the second row
        out = torch.zeros(len(h), 8)
        out[1, 5] = bad
        return out

    s = Scorer("fake", lambda ids: ids[..., None].float(), head, torch.device("cpu"))
    with pytest.raises(NonFiniteLogits, match="non-finite logits .* at window 3, position 1"):
        score_batch(s, [Request([1], [2, 3, 4])], 8, 0, "window", 3)


def test_a_batchs_forward_runs_without_cudnn_attention_on_the_scorers_device(monkeypatch) -> None:
    """Evaluation batches change length from one to the next: on CUDA each new length would cost cuDNN's attention a
    new plan, so the forward runs with it excluded (asked for the scorer's device; here the CPU's answer is swapped
    for CUDA's, whose flags a CPU build holds too) and the flags are put back after."""
    from gpt2_port.devices import without_cudnn_attention
    from gpt2_port.eval import score

    asked: list[str] = []

    def as_on_cuda(device: torch.device):  # noqa: ANN202
        asked.append(device.type)
        return without_cudnn_attention(torch.device("cuda"))

    seen: list[bool] = []

    def hidden(ids: torch.Tensor) -> torch.Tensor:
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return F.one_hot(ids, 8).float()  # (B, T, 8)

    monkeypatch.setattr(score, "without_cudnn_attention", as_on_cuda)
    s = Scorer("fake", hidden, lambda h: h, torch.device("cpu"), vocab_size=8)
    score_batch(s, [Request([1], [2, 3])], 8, 0)
    assert asked == ["cpu"] and seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()
