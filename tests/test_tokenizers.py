"""Tokenizers: round trips, special ids, and JetStream tokenizer API compliance.

The Hugging Face tokenizer is trained here (byte-level BPE on a few sentences): no downloads.
"""

import json

import numpy as np
import pytest
from jetstream.engine import tokenizer_api

from dvp_jax.tokenizers import (
    CHAR_VOCAB,
    CharTokenizer,
    HFTokenizer,
    WordTokenizer,
    load_tokenizer,
)

CORPUS = [
    "what is 12 plus 34? the answer is 46.",
    "solve the following math problem step by step.",
    "Let x = 1/2. Then 2x = 1, so \\boxed{1}.",
    "héllo wörld ✓ 数学",
] * 20


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    d = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": "<pad>", "bos_token": {"content": "<s>"}})
    )
    return d


# ----------------------------------------------------------------------------------------------
# CharTokenizer
# ----------------------------------------------------------------------------------------------


def test_char_round_trip_and_ids():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(CHAR_VOCAB) == len(set(CHAR_VOCAB)) + 3
    text = "what is 12 plus 34? 46. (7*8-3)/2=x, y: z! it's\n"
    ids = tok.encode_ids(text)
    assert min(ids) >= 3 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    # Specials are dropped by default, kept on request; unknown ids never raise.
    assert tok.decode([1] + ids[:3] + [2, 0, 0]) == text[:3]
    assert tok.decode([1, 5, 2], skip_special_tokens=False) == "<bos>2<eos>"
    assert tok.decode([5, 999, -1]) == "2\ufffd\ufffd"


def test_char_rejects_unknown_character():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"'A'.*position 3"):
        tok.encode_ids("12+A")
    with pytest.raises(ValueError, match="U\\+00E9"):
        tok.encode("é")


@pytest.mark.parametrize("tok_factory", ["char", "hf"])
def test_jetstream_encode_contract(tok_factory, hf_dir):
    tok = CharTokenizer() if tok_factory == "char" else HFTokenizer(hf_dir)
    # JetStream's API, though not inherited (tokenizers.py imports no JetStream): every abstract
    # member is there, and the adapter registers the classes as JetStream tokenizers.
    assert all(hasattr(tok, name) for name in tokenizer_api.Tokenizer.__abstractmethods__)
    import dvp_jax.serve.jetstream  # noqa: F401

    assert isinstance(tok, tokenizer_api.Tokenizer)
    assert tok.stop_tokens >= {tok.eos_id, tok.pad_id}
    text = "12 plus 34"
    ids = tok.encode_ids(text)
    tokens, true_length = tok.encode(text)  # JetStream defaults: BOS, jax padding, buckets.
    assert true_length == len(ids) + 1 and tokens.shape == (16,)
    assert hasattr(tokens, "devices")  # A jax.Array.
    np.testing.assert_array_equal(np.asarray(tokens[:true_length]), [tok.bos_id] + ids)
    assert set(np.asarray(tokens[true_length:]).tolist()) <= {tok.pad_id}
    tokens, n = tok.encode(text, is_bos=False, jax_padding=False, max_prefill_length=12)
    assert isinstance(tokens, np.ndarray) and tokens.shape == (12,) and n == len(ids)
    tokens, n = tok.encode(text * 3, prefill_lengths=[8, 64], jax_padding=False)
    assert n == 3 * len(ids) + 1 or tok_factory == "hf"  # BPE may merge across repeats.
    assert tokens.shape == (64,)
    with pytest.raises(ValueError, match="largest prefill length 8"):
        tok.encode(text * 3, max_prefill_length=8)
    assert tok.decode(np.asarray(tokens)) == text * 3  # BOS and padding decode to nothing.


def test_jetstream_pad_tokens_and_result_processing_agree():
    """Our padding equals JetStream's `pad_tokens`; its streaming detokeniser works with ours."""
    from jetstream.engine import token_utils

    tok = CharTokenizer()
    ids = np.asarray(tok.encode_ids("7*8-3="))
    ours, n = tok.encode("7*8-3=", jax_padding=False)
    theirs, m = token_utils.pad_tokens(ids, tok.bos_id, tok.pad_id, jax_padding=False)
    np.testing.assert_array_equal(ours, theirs)
    assert n == m

    # One slot, one sample, three generation steps: "5", "3", EOS.
    class Result:
        def __init__(self, t):
            self.tokens, self.valid = np.array([[t]]), np.array([[True]])
            self.lengths = np.array([1])

        def get_result_at_slot(self, slot):
            return self

    complete, text = np.zeros((1,), bool), ""
    for t in tok.encode_ids("53") + [tok.eos_id]:
        samples, complete = token_utils.process_result_tokens(tok, 0, 100, Result(t), complete)
        text += "".join(samples[0].text)
    assert text == "53" and complete.all()


# ----------------------------------------------------------------------------------------------
# HFTokenizer
# ----------------------------------------------------------------------------------------------


def test_hf_round_trip_and_specials_from_config(hf_dir):
    tok = HFTokenizer(hf_dir)  # A directory: tokenizer.json + tokenizer_config.json.
    raw = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    assert tok.eos_id == vocab["</s>"] and tok.pad_id == vocab["<pad>"]
    assert tok.bos_id == vocab["<s>"] and tok.add_bos
    assert tok.vocab_size == len(vocab)
    for text in CORPUS[:4] + ["unseen words 987 ∑ ok"]:
        assert tok.decode(tok.encode_ids(text)) == text
    ids = tok.encode_ids("the answer")
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == "the answer"
    assert tok.decode(ids + [10_000]) == "the answer\ufffd"


def test_hf_arguments_and_fallbacks(hf_dir, tmp_path):
    # A bare tokenizer.json: EOS from the well-known names ("</s>" here).
    (tmp_path / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
    bare = tmp_path / "tokenizer.json"
    assert HFTokenizer(bare).eos_id == HFTokenizer(hf_dir).eos_id
    # A vocabulary with no known EOS name: it must be given.
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"<unk>": 0, "[END]": 1, "a": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    with pytest.raises(ValueError, match="pass eos="):
        HFTokenizer(tmp_path / "words.json")
    assert HFTokenizer(tmp_path / "words.json", eos="[END]").encode_ids("a a b") == [2, 2, 0]
    tok = HFTokenizer(bare, eos="</s>", stop_tokens=["<|im_end|>"])
    assert tok.pad_id == tok.eos_id  # pad defaults to EOS.
    assert tok.bos_id == tok.eos_id and not tok.add_bos  # No BOS: Qwen convention.
    assert tok.stop_tokens == {tok.eos_id, tok._tok.token_to_id("<|im_end|>")}
    _, n = tok.encode("the answer", jax_padding=False)
    assert n == len(tok.encode_ids("the answer"))  # No BOS prepended.
    assert HFTokenizer(bare, eos=2, pad=0).pad_id == 0
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer(bare, eos="<nope>")
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        HFTokenizer(tmp_path / "missing")


def test_load_tokenizer(hf_dir):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    words = load_tokenizer("running_sum:10")
    assert isinstance(words, WordTokenizer) and words.vocab_size == 4 + 4 + 1000 + 10
    assert words.decode(words.encode_ids("sum 12 7 = + 12 = 12 baba <ans> 19")) == (
        "sum 12 7 = + 12 = 12 baba <ans> 19"
    )
    with pytest.raises(ValueError, match="takes no options"):
        load_tokenizer("running_sum", eos="<eos>")
    assert isinstance(load_tokenizer(str(hf_dir)), HFTokenizer)
    tok = CharTokenizer()
    assert load_tokenizer(tok) is tok


# ----------------------------------------------------------------------------------------------
# Hugging Face export: transformers loads our model and our tokenizer from one directory.
# ----------------------------------------------------------------------------------------------

# Our fp32 logits vs transformers' fp32 logits of the exported model: different summation order;
# differences are ~1e-7 (tests/test_hf_import.py), the stated tolerance is 1e-4.
HF_ATOL = 1e-4
CHAR_TEXTS = ["what is 12 plus 34? the answer is 46.", "(7*8-3)/2 = x, y: z! it's\n ok"]
HF_TEXTS = CORPUS[:4] + ["unseen words 987 ∑ ok", "  leading spaces . and ( odd ) spacing ?"]


def _export_case(kind, hf_dir, tmp_path):
    """(tokenizer, sample texts) for each way a tokenizer can handle BOS."""
    if kind == "char":
        return CharTokenizer(), CHAR_TEXTS
    if kind == "running_sum":  # The word-level tokenizer built in memory.
        from dvp_jax.data.running_sum import RunningSumTask

        ex = RunningSumTask().train_example(0)
        return load_tokenizer("running_sum"), [ex.prompt, ex.target, ex.prompt + " " + ex.target]
    if kind == "hf_bos":  # BOS from tokenizer_config.json, prepended.
        return HFTokenizer(hf_dir), HF_TEXTS
    if kind == "hf_bos_not_added":  # A BOS token exists but encode does not prepend it.
        return HFTokenizer(hf_dir, add_bos=False), HF_TEXTS
    # A bare tokenizer.json (the Qwen convention): no BOS, pad = EOS, an extra stop token.
    (tmp_path / "bare.json").write_text((hf_dir / "tokenizer.json").read_text())
    return HFTokenizer(tmp_path / "bare.json", stop_tokens=["<|im_end|>"]), HF_TEXTS


@pytest.mark.parametrize("kind", ["char", "hf_bos", "hf_bos_not_added", "hf_bare", "running_sum"])
def test_save_hf_transformers_loads_tokenizer_and_model(kind, hf_dir, tmp_path):
    import tokenizers
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dvp_jax.model.hf_import import save_hf
    from tests.helpers import tiny_model

    tok, texts = _export_case(kind, hf_dir, tmp_path)
    model = tiny_model(seed=5, vocab_size=-(-tok.vocab_size // 64) * 64)
    out = tmp_path / "export"
    save_hf(model, str(out))
    tok.save_hf(out)

    theirs = AutoTokenizer.from_pretrained(out)
    assert (theirs.eos_token_id, theirs.pad_token_id) == (tok.eos_id, tok.pad_id)
    if tok.add_bos:
        assert theirs.bos_token_id == tok.bos_id
    again = HFTokenizer(out)  # Our own loader reads the export back to the same tokenizer.
    assert (again.eos_id, again.pad_id, again.bos_id, again.add_bos) == (
        tok.eos_id,
        tok.pad_id,
        tok.bos_id,
        tok.add_bos,
    )
    file = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))  # What older readers see.
    for text in texts:
        padded, n = tok.encode(text, jax_padding=False)
        ours = np.asarray(padded[:n]).tolist()
        assert ours == ([tok.bos_id] if tok.add_bos else []) + tok.encode_ids(text)
        assert theirs(text)["input_ids"] == ours, text
        assert theirs(text, add_special_tokens=False)["input_ids"] == tok.encode_ids(text)
        assert file.encode(text).ids == ours, text
        assert again.encode_ids(text) == tok.encode_ids(text)
        with_stops = ours + [tok.eos_id, tok.pad_id]
        assert theirs.decode(with_stops, skip_special_tokens=True) == text
        assert tok.decode(with_stops) == text

    # The exported model on transformers' ids (right-padded batch) gives our logits on our ids.
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    batch = theirs(texts, padding=True, return_tensors="np")
    tokens, valid = batch["input_ids"], batch["attention_mask"].astype(bool)
    with torch.no_grad():
        hf_logits = hf_model(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(np.int64))
        ).logits.numpy()
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    our_logits = np.asarray(model(tokens.astype(np.int32), positions, valid))
    np.testing.assert_allclose(our_logits[valid], hf_logits[valid], rtol=0, atol=HF_ATOL)
