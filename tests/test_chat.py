"""Chat turns and generation defaults as the checkpoint releases them (runner/chat.py), through the CLI, `--serve`
and the Triton model's payload."""

import io
import json

import pytest

from runner.chat import GenerationDefaults, check_messages, render_chat
from runner.tokenizer import load_tokenizer
from tests.conftest import mpirun

TURNS = [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "Hello!"}]


def test_the_template_renders_turns_and_thinking(release_engine):
    template = load_tokenizer(release_engine / "tokenizer", 512).config["chat_template"]
    on = render_chat(template, TURNS)
    off = render_chat(template, TURNS, thinking=False)
    assert on == ("<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>Hello!"
                  "<|im_end|><|im_assistant|>assistant<|im_middle|>")  # fmt: skip
    assert off == on + "<think></think>"


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "must be a non-empty list"),
        ("hi", "must be a non-empty list"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\].role must be one of"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string, got int"),
        ([{"role": "user", "content": "x", "name": "n"}], r"messages\[0\] must be an object with role and content"),
    ],
)
def test_bad_messages_are_named(messages, message):
    with pytest.raises(ValueError, match=message):
        check_messages(messages)


def test_generation_defaults(release_engine, demo_hf):
    release = GenerationDefaults.load(release_engine / "tokenizer")
    assert release.end_ids == {481, 482} and release.temperature == 0.6 and release.top_p == 0.95
    params, applied = release.sampling(top_p=0.5)
    assert (params.temperature, params.top_p) == (0.6, 0.5) and applied == {"temperature": 0.6}
    greedy = GenerationDefaults.load(demo_hf / "kimi-k2-tiny", eos_token_id=481)  # do_sample: false
    assert greedy.sampling()[0].greedy and greedy.end_ids == {481}
    assert GenerationDefaults.load(demo_hf, eos_token_id=7).end_ids == {7}  # no file: the target's eos


def test_cli_chat_under_mpirun(release_engine, tmp_path):
    """The release layout at TP-8 under mpirun -np 8: --chat renders each prompt as a user turn (thinking on and
    off); sampling left unset takes generation_config.json's temperature and top-p, and the CLI says so; the stop
    ids are the release's."""
    tokenizer = load_tokenizer(release_engine / "tokenizer", 512)
    template = tokenizer.config["chat_template"]
    results = {}
    for thinking in ("on", "off"):
        out = tmp_path / f"{thinking}.json"
        done = mpirun(8, "-m", "runner", "--engine_dir", str(release_engine), "--backend", "torch", "--chat",
                      "--system", "You are Kimi.", "--input_text", "Hello!", "--thinking", thinking,
                      "--max_output_len", "8", "--output_json", str(out))  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        assert "sampling: temperature 0.6, top_p 0.95 from the checkpoint's generation_config.json" in done.stdout
        results[thinking] = json.loads(out.read_text())
    for thinking, report in results.items():
        expected = tokenizer.encode(render_chat(template, TURNS, thinking == "on"))
        assert report["results"][0]["prompt_ids"] == expected
        assert report["end_ids"] == [481, 482]
        assert report["sampling"]["from_generation_config"] == {"temperature": 0.6, "top_p": 0.95}


def test_serve_takes_messages_and_says_which_defaults_it_used(release_engine):
    from engines.engine_dir import load_engine_dir
    from runner.factory import CheckpointWeights, RankOptions, local_ranks
    from runner.generator import Generator
    from runner.serving.serve import serve

    engine = load_engine_dir(release_engine)
    ranks = local_ranks(CheckpointWeights(engine.checkpoint_dir), RankOptions(device="cpu"), engine.spec,
                        engine.build_config)  # fmt: skip
    tokenizer = load_tokenizer(engine.tokenizer_dir, 512)
    lines = [
        {"id": "chat", "messages": TURNS, "thinking": False, "max_tokens": 4},
        {"id": "set", "messages": TURNS, "max_tokens": 4, "temperature": 0.0},
        {"id": "both", "messages": TURNS, "text_input": "x", "max_tokens": 4},
        {"id": "bad", "messages": [{"role": "user"}], "max_tokens": 4},
    ]
    out = io.StringIO()
    serve(Generator(ranks), tokenizer, engine, engine.spec, "torch", inp=io.StringIO("\n".join(map(json.dumps, lines))),
          out=out)  # fmt: skip
    finals = {e["id"]: e for e in map(json.loads, out.getvalue().splitlines()[1:]) if e["event"] != "tokens"}
    chat = finals["chat"]
    assert chat["event"] == "done" and chat["prompt_text"].endswith("<|im_middle|><think></think>")
    assert chat["sampling"]["from_generation_config"] == {"temperature": 0.6, "top_p": 0.95}
    assert finals["set"]["sampling"]["temperature"] == 0.0
    assert finals["set"]["sampling"]["from_generation_config"] == {"top_p": 0.95}
    assert "exactly one of text_input and messages" in finals["both"]["error"]
    assert "messages[0].content must be a string" in finals["bad"]["error"]
    ranks.close()
