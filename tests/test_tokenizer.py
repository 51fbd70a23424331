"""The tokenizer in both formats a checkpoint ships: tokenizer.json, and Kimi K2.x's release layout (tiktoken.model
+ tokenizer_config.json) made offline by `builder.demo_checkpoints --tiktoken` from the same BPE."""

import io
import json

import pytest

from builder.tokenizer import CORPUS, SPECIAL_TOKENS
from runner.tokenizer import Detokenizer, HFTokenizer, TextStream, TiktokenTokenizer, encode_prompt, load_tokenizer
from tests.conftest import mpirun

TEXTS = [
    *CORPUS.splitlines(),
    "Hello world! 你好，世界。中文English混合 ünïcödé 🙂 Ça va? ½ ∑ x²",
    "  leading spaces, tabs\tand\nnew lines\r\n",
    "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>",
]


@pytest.fixture(scope="module")
def tiktoken_tokenizer(demo_hf):
    return load_tokenizer(demo_hf / "kimi-k2-tiny-tiktoken", 512)


def test_the_release_layout_loads_with_tiktoken(demo_hf, tiktoken_tokenizer):
    files = {p.name for p in (demo_hf / "kimi-k2-tiny-tiktoken").iterdir()}
    assert {"tiktoken.model", "tokenizer_config.json"} <= files and "tokenizer.json" not in files
    assert isinstance(tiktoken_tokenizer, TiktokenTokenizer) and tiktoken_tokenizer.vocab_size == 512
    assert isinstance(load_tokenizer(demo_hf / "kimi-k2-tiny", 512), HFTokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trips(tiktoken_tokenizer, text):
    ids = tiktoken_tokenizer.encode(text)
    assert tiktoken_tokenizer.decode(ids) == text and all(0 <= i < 512 for i in ids)


def test_the_special_block(tiktoken_tokenizer):
    """Kimi's special tokens at the top of the vocabulary, in its order; each is one id in text, dropped by
    skip_special_tokens, and [UNK] (the DFlash mask) and [PAD] are the last two ids."""
    base = 512 - len(SPECIAL_TOKENS)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tiktoken_tokenizer.token_id(name) == base + i
        assert tiktoken_tokenizer.encode(name) == [base + i]
    assert tiktoken_tokenizer.token_id("[UNK]") == 510 and tiktoken_tokenizer.token_id("[PAD]") == 511
    ids = tiktoken_tokenizer.encode("<|im_user|>hi<|im_end|>")
    assert ids[0] == tiktoken_tokenizer.token_id("<|im_user|>") and ids[-1] == tiktoken_tokenizer.token_id("<|im_end|>")
    assert tiktoken_tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_the_pre_tokenizer_splits_han_runs(tiktoken_tokenizer):
    """Kimi's pattern puts Han runs in their own pieces: no id spans the boundary between Han and Latin text."""
    han, latin = "中文", "English"
    assert tiktoken_tokenizer.encode(han + latin) == tiktoken_tokenizer.encode(han) + tiktoken_tokenizer.encode(latin)


@pytest.mark.parametrize("name", ["kimi-k2-tiny", "kimi-k2-tiny-tiktoken"])
def test_streaming_detokenisation_across_multibyte_characters_and_specials(demo_hf, name):
    """Token by token, the streamed text never shows half a character and ends equal to the whole decode."""
    tokenizer = load_tokenizer(demo_hf / name, 512)
    text = "你好 🙂 ünï<|im_end|>ok 中文"
    ids = tokenizer.encode(text)
    out = io.StringIO()
    stream = TextStream(tokenizer, out)
    seen = []
    for token in ids:
        stream([token])
        seen.append(out.getvalue())
    assert all("\ufffd" not in s for s in seen)
    assert out.getvalue() == tokenizer.decode(ids, skip_special_tokens=True) == "你好 🙂 ünïok 中文"


def test_errors_name_the_files(tmp_path, demo_hf):
    with pytest.raises(FileNotFoundError, match="has neither tokenizer.json nor tiktoken.model"):
        load_tokenizer(tmp_path, 512)
    with pytest.raises(ValueError, match="has 480 BPE ranks; the engine's vocab_size=480 leaves no room"):
        load_tokenizer(demo_hf / "kimi-k2-tiny-tiktoken", 480)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tiktoken.model").write_text((demo_hf / "kimi-k2-tiny-tiktoken" / "tiktoken.model").read_text())
    config = json.loads((demo_hf / "kimi-k2-tiny-tiktoken" / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["7"] = {"content": "<|oops|>", "special": True}
    (bad / "tokenizer_config.json").write_text(json.dumps(config))
    message = r"special token '<\|oops\|>' with id 7, outside the special block \[480, 512\)"
    with pytest.raises(ValueError, match=message):
        load_tokenizer(bad, 512)
    with pytest.raises(ValueError, match="prompt of 4096 bytes is at least"):
        encode_prompt(load_tokenizer(demo_hf / "kimi-k2-tiny-tiktoken", 512), "x" * 4096, 64)


def test_a_release_layout_engine_runs_under_mpirun(demo_hf, tmp_path):
    """build-engine copies tiktoken.model and tokenizer_config.json; `mpirun -np 2 python -m runner` reads them and
    emits the same ids as the tokenizer.json engine of the same weights (where both encode the prompt alike)."""
    from builder.cli import main as cli_main

    prompt = "Hello world! How are you today?"
    outputs = {}
    for name in ("kimi-k2-tiny", "kimi-k2-tiny-tiktoken"):
        engine = tmp_path / name
        args = ["--model_dir", str(demo_hf / name), "--draft_model_dir", str(demo_hf / "kimi-k2-tiny-dflash"),
                "--tp_size", "2", "--output_dir", str(engine), "--max_input_len", "64", "--max_seq_len", "512",
                "--no_onnx"]  # fmt: skip
        assert cli_main(args) == 0
        out = tmp_path / f"{name}.json"
        done = mpirun(2, "-m", "runner", "--engine_dir", str(engine), "--backend", "torch", "--input_text", prompt,
                      "--max_output_len", "24", "--output_json", str(out), "--temperature", "0",
                      "--end_id", "-1")  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[name] = json.loads(out.read_text())["results"][0]
    plain, release = outputs["kimi-k2-tiny"], outputs["kimi-k2-tiny-tiktoken"]
    assert release["prompt_ids"] == plain["prompt_ids"] and release["output_ids"] == plain["output_ids"]
    assert release["text"] == plain["text"]


@pytest.mark.parametrize("name", ["kimi-k2-tiny", "kimi-k2-tiny-tiktoken"])
def test_the_detokenizer_decodes_a_window_not_the_whole_text(demo_hf, name):
    """`Detokenizer.push` decodes only the tokens since the last complete text: its pieces add up to the whole
    decode, token by token and in uneven batches, and a long text costs no more a token at its end than at its
    start (counted in tokens decoded)."""
    tokenizer = load_tokenizer(demo_hf / name, 512)
    ids = tokenizer.encode("你好 🙂 ünï<|im_end|>ok 中文, and more words. " * 40)
    for sizes in ([1], [3, 1, 2]):
        detokenizer, pieces, start, i = Detokenizer(tokenizer), [], 0, 0
        while start < len(ids):
            step = sizes[i % len(sizes)]
            pieces.append(detokenizer.push(ids[start : start + step]))
            start, i = start + step, i + 1
        pieces.append(detokenizer.finish())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in piece for piece in pieces)
    decoded = []
    counting = type("Counting", (), {"decode": lambda self, t, skip_special_tokens: decoded.append(len(t)) or
                                     tokenizer.decode(t, skip_special_tokens=skip_special_tokens)})()  # fmt: skip
    detokenizer = Detokenizer(counting)
    for token in ids:
        detokenizer.push([token])
    assert max(decoded) <= 16  # a window of a few tokens, not the whole text (len(ids) > 400)
