"""Fault injection: malformed files, flags and stdin, wrong types above all.

The promise: no input from a file, a flag or stdin produces a traceback;
each gets one ``error:`` line naming the file, flag or stream and what is
wrong, and a non-zero exit. Covered here: calibration files, hand-made GGUF
files, model folders, traces and evaluation reports for ``analyze``,
evaluation results for ``evaluate --from-json``, ``evaluate --out``, chat
templates that raise, random bytes on stdin, and every range-checked flag of
``generate``.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fault_models import copy_model, tiny_model_folder

from gearbx_mlx import analyze, evaluate
from gearbx_mlx.calibration import Calibration
from gearbx_mlx.chat import RAW_PROMPT_NOTICE, apply_chat_template
from gearbx_mlx.gearbox import Gearbox
from gearbx_mlx.generation import check_generation_options
from gearbx_mlx.sources import models
from gearbx_mlx.sources.gguf import read_gguf_header
from gearbx_mlx.telemetry.trace import TraceError, read_trace

generate = importlib.import_module("gearbx_mlx.generate")
VOCAB = 266  # the tiny model's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("input"))


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def gen(capsys, *args: str) -> tuple:
    code = generate.main(list(args))
    return code, capsys.readouterr().err


# -- calibration files --------------------------------------------------------------------------------------
GOOD_CAL = {"format": 1, "low": 1.0, "high": 2.5, "strategy": "median", "n_samples": 10, "vocab_size": VOCAB,
            "model": "m", "created": "now", "extra": {}}


@pytest.mark.parametrize("change, message", [
    ({"low": "abc"}, "'low' must be a finite number"),
    ({"low": None}, "'low' must be a finite number"),
    ({"low": True}, "'low' must be a finite number"),
    ({"high": float("nan")}, "'high' must be a finite number"),
    ({"high": 1e300}, "above log2(266)"),
    ({"low": 3.0, "high": 2.0}, "wrong order"),
    ({"vocab_size": str(VOCAB)}, "'vocab_size' must be an integer >= 2"),
    ({"vocab_size": 0}, "'vocab_size' must be an integer >= 2"),
    ({"strategy": 5}, "'strategy' must be one of"),
    ({"n_samples": -1}, "'n_samples' must be an integer >= 0"),
    ({"extra": []}, "'extra' must be an object"),
    ({"surprise": 1}, "unknown fields ['surprise']"),
    ({"format": 2}, "not a gearbx calibration file"),
])
def test_calibration_files_of_the_wrong_type(tmp_path, change, message):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({**GOOD_CAL, **change}))
    with pytest.raises(ValueError) as e:
        Calibration.load(p)
    assert message in str(e.value) and str(p) in str(e.value)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe\x00\x01", b"[" * 100_000])
def test_calibration_files_that_are_not_json_objects(tmp_path, content):
    p = tmp_path / "cal.json"
    p.write_bytes(content)
    with pytest.raises(ValueError, match="cal.json"):
        Calibration.load(p)
    missing = {k: v for k, v in GOOD_CAL.items() if k != "vocab_size"}
    p.write_text(json.dumps(missing))
    with pytest.raises(ValueError, match=r"missing \['vocab_size'\]"):
        Calibration.load(p)


def test_a_calibration_for_another_vocabulary_says_which(tiny_llama, tmp_path):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({**GOOD_CAL, "vocab_size": 49152}))
    with pytest.raises(ValueError, match="made for a vocabulary of 49152 tokens, this model has 256"):
        Gearbox(tiny_llama).set_calibration(Calibration.load(p))


def test_a_bad_calibration_through_the_cli(tiny, tmp_path, capsys):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({**GOOD_CAL, "high": 1e300}))
    code, err = gen(capsys, "--model", str(tiny), "--prompt", "hi", "--calibration", str(p))
    line = one_error_line(err)
    assert code == 1 and str(p) in line and "above log2" in line and len(line) < 400


# -- the KV block of a calibration file ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def kv_block(tiny) -> dict:
    """The tiny model's KV statistics, as a calibration file stores them."""
    from mlx_lm import load

    from gearbx_mlx.kvcache import calibrate_weights

    model, _ = load(str(tiny))
    return json.loads(json.dumps(calibrate_weights(model).to_dict()))


def _trim(layer: dict, fields=None) -> None:
    for f in fields or list(layer):
        layer[f] = [row[:-1] for row in layer[f]]


def _damaged_kv(kv: dict, damage: str) -> dict:
    kv = json.loads(json.dumps(kv))
    layers = kv["layers"]
    if damage == "one statistic's shape":
        _trim(layers[0], ["k_var"])
    elif damage == "a layer's shape":
        _trim(layers[1])
    elif damage == "a layer missing":
        layers.pop()
    elif damage == "NaN":
        layers[1]["k_mean"][0][3] = float("nan")
    elif damage == "infinity":
        layers[0]["q_energy"][1][0] = float("inf")
    elif damage == "text":
        layers[0]["v_mean"] = "zeros"
    elif damage == "fingerprint":
        kv["fingerprint"]["head_dim"] = "64"
    elif damage == "absurd":
        layers[0]["k_mean"] = [[1e300] * len(row) for row in layers[0]["k_mean"]]
    elif damage == "no source":
        kv["source"] = None
    return kv


KV_DAMAGE = {
    "one statistic's shape": "layers[0].k_var has shape",
    "a layer's shape": "layers[1] statistics have shape",
    "a layer missing": "'layers' has 1 layers, the fingerprint's model has 2",
    "NaN": "layers[1].k_mean holds NaN or infinity",
    "infinity": "layers[0].q_energy holds NaN or infinity",
    "text": "layers[0].v_mean is not a (n_kv_heads, head_dim) array of numbers",
    "fingerprint": "'fingerprint' needs n_layers",
    # finite, but overflowing the transform into NaN logits (exit 0, <|endoftext|> only)
    "absurd": "layers[0].k_mean holds 1e+300, beyond any key or query statistic",
    "no source": "'source' must name where the statistics came from, got None",
}


@pytest.mark.parametrize("damage", list(KV_DAMAGE))
def test_a_damaged_kv_block_is_refused_when_the_file_is_read(kv_block, tmp_path, damage):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({**GOOD_CAL, "kv": kv_block}))
    assert Calibration.load(p).kv == kv_block  # the undamaged block is accepted
    p.write_text(json.dumps({**GOOD_CAL, "kv": _damaged_kv(kv_block, damage)}))
    with pytest.raises(ValueError) as e:
        Calibration.load(p)
    assert str(p) in str(e.value) and "field 'kv'" in str(e.value) and KV_DAMAGE[damage] in str(e.value)


@pytest.mark.parametrize("damage", ["one statistic's shape", "NaN"])
def test_a_damaged_kv_block_through_the_cli_is_one_error_line(tiny, kv_block, tmp_path, capsys, damage):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({**GOOD_CAL, "kv": _damaged_kv(kv_block, damage)}))
    code, err = gen(capsys, "--model", str(tiny), "--prompt", "hi", "--calibration", str(p), "--kv-bits", "4",
                    "--max-tokens", "2")
    line = one_error_line(err)
    assert code == 1 and str(p) in line and KV_DAMAGE[damage] in line


def test_kv_statistics_of_another_shape_than_the_model_name_the_layer(tiny, kv_block):
    """A block consistent with its own fingerprint, for a model of another head size."""
    from mlx_lm import load

    from gearbx_mlx.kvcache import KVCalibration
    from gearbx_mlx.kvcache.calibrate import model_fingerprint

    kv = json.loads(json.dumps(kv_block))
    for layer in kv["layers"]:
        _trim(layer)
    kv["fingerprint"]["head_dim"] = [d - 1 for d in kv["fingerprint"]["head_dim"]]
    cal = KVCalibration.from_dict(kv)
    model, _ = load(str(tiny))
    cal.fingerprint = model_fingerprint(model)  # a fingerprint that agrees, statistics that do not
    with pytest.raises(ValueError, match=r"layers\[0\] statistics have shape \(2, 15\); the model's layer 0"):
        cal.check(model)


# -- GGUF files ------------------------------------------------------------------------------------------------
def s(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


HEAD = b"GGUF" + struct.pack("<I", 3)


def gguf_bytes(n_tensors: int, kvs: bytes, n_kv: int, tensors: bytes = b"") -> bytes:
    return HEAD + struct.pack("<QQ", n_tensors, n_kv) + kvs + tensors


@pytest.mark.parametrize("content, message", [
    (b"", "is not a GGUF file (0 bytes)"),
    (b"GGUF\x03", "is not a GGUF file (5 bytes)"),
    (b"GGML" + b"\0" * 40, "is not a GGUF file"),
    (b"GGUF" + struct.pack("<IQQ", 7, 0, 0), "version 7"),
    (gguf_bytes(0, b"", 10**12), "truncated or corrupt"),  # absurd key count
    (gguf_bytes(0, struct.pack("<Q", 2**62), 1), "truncated or corrupt"),  # absurd key length
    (gguf_bytes(0, s("k") + struct.pack("<I", 99), 1), "unknown GGUF value type 99"),
    (gguf_bytes(0, s("k") + struct.pack("<IIQ", 9, 77, 3), 1), "unknown GGUF array element type 77"),
    (gguf_bytes(0, s("k") + struct.pack("<IIQ", 9, 4, 2**61), 1), "truncated or corrupt"),  # absurd array
    (gguf_bytes(0, s("k") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 20, 1), "nested deeper"),
    (gguf_bytes(0, s("general.alignment") + struct.pack("<II", 4, 0), 1), "alignment must be a positive multiple"),
    (gguf_bytes(0, s("general.alignment") + struct.pack("<II", 4, 3), 1), "alignment must be a positive multiple"),
    (gguf_bytes(0, s("general.alignment") + struct.pack("<I", 8) + s("x"), 1), "alignment must be"),
    (gguf_bytes(1, b"", 0, s("t") + struct.pack("<I", 0)), "0 dimensions"),
    (gguf_bytes(1, b"", 0, s("t") + struct.pack("<IQIQ", 1, 1000, 0, 0)), "past the end of the file"),
])
def test_hand_made_gguf_files_fail_with_the_file_and_the_fault(tmp_path, content, message):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_gguf_header(p)
    assert message in str(e.value) and str(p) in str(e.value)


@pytest.mark.parametrize("head_count", ["four", None, 2.5])
def test_a_gguf_with_metadata_of_the_wrong_type_through_the_cli(tmp_path, capsys, monkeypatch, head_count):
    from test_models import write_gguf

    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path / "cache"))
    meta = {"general.architecture": "qwen2", "qwen2.embedding_length": 32, "qwen2.block_count": 1}
    if head_count is not None:
        meta["qwen2.attention.head_count"] = head_count
    p = tmp_path / "bad.gguf"
    write_gguf(p, meta, {"token_embd.weight": ((8, 32), 0, np.zeros((8, 32), "<f4").tobytes())})
    code, err = gen(capsys, "--model", str(p), "--prompt", "hi")
    assert code == 1 and str(p) in one_error_line(err)


def test_an_empty_gguf_through_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    code, err = gen(capsys, "--model", str(p), "--prompt", "hi")
    assert code == 1 and "empty.gguf is not a GGUF file (0 bytes)" in one_error_line(err)
    assert not any((tmp_path / "cache" / "models").iterdir())  # nothing half-made in the cache


# -- model folders --------------------------------------------------------------------------------------------------
def _break_config(folder: Path) -> None:
    (folder / "config.json").write_text("{not json")


def _break_types(folder: Path) -> None:
    c = json.loads((folder / "config.json").read_text())
    c["num_hidden_layers"] = "two"
    (folder / "config.json").write_text(json.dumps(c))


def _truncate_weights(folder: Path) -> None:
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])


def _garble_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").write_text("garbage")


def _drop_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


@pytest.mark.parametrize("damage", [_break_config, _break_types, _truncate_weights, _garble_tokenizer, _drop_weights])
def test_broken_model_folders_are_one_error_line(tiny, tmp_path, capsys, damage):
    folder = copy_model(tiny, tmp_path / "m")
    damage(folder)
    code, err = gen(capsys, "--model", str(folder), "--prompt", "hi", "--max-tokens", "2")
    line = one_error_line(err)
    assert code == 1 and str(folder) in line and len(line) < 600


# -- chat templates, stdin ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [
    "{{ raise_exception('no\\nsuch\\nluck') }}",  # raises on purpose, with newlines
    "{% for %}",  # does not parse
    "{{ messages[99]['content'] }}",  # fails while rendering
])
def test_a_chat_template_that_fails_is_one_error_line(tiny, tmp_path, capsys, template):
    folder = copy_model(tiny, tmp_path / "m", chat_template=template)
    trace = tmp_path / "t.jsonl"
    code, err = gen(capsys, "--model", str(folder), "--prompt", "hi", "--trace", str(trace))
    line = one_error_line(err)
    assert code == 1 and "chat template failed" in line and "--ignore-chat-template" in line
    t = read_trace(trace)
    assert t.summary["interrupted"] is False and "chat template failed" in t.summary["error"]


def test_a_base_model_without_a_chat_template_says_so_once(tiny, tmp_path, capsys):
    """A base model gets the prompt as raw text, and the user is told, once (not per prompt or sample)."""
    code, err = gen(capsys, "--model", str(tiny), "--prompt", "hi", "--max-tokens", "3")
    assert code == 0 and err.count(RAW_PROMPT_NOTICE) == 1, err
    chat = copy_model(tiny, tmp_path / "chat", chat_template="{{ messages[0]['content'] }}")
    code, err = gen(capsys, "--model", str(chat), "--prompt", "hi", "--max-tokens", "3")
    assert code == 0 and RAW_PROMPT_NOTICE not in err, err


def test_a_system_prompt_without_a_chat_template_is_said_to_be_unused(tiny, tmp_path, capsys):
    """mlx-lm drops --system-prompt on a model without a template (or with --ignore-chat-template) silently."""
    code, err = gen(capsys, "--model", str(tiny), "--prompt", "hi", "--max-tokens", "2", "--system-prompt", "Be brief.")
    assert code == 0 and "the system prompt is not used: this model has no chat template" in err, err
    chat = copy_model(tiny, tmp_path / "chat", chat_template="{{ messages[0]['content'] }}")
    code, err = gen(capsys, "--model", str(chat), "--prompt", "hi", "--max-tokens", "2", "--system-prompt", "Be brief.",
                    "--ignore-chat-template")
    assert code == 0 and "the system prompt is not used: the chat template is off" in err, err
    code, err = gen(capsys, "--model", str(chat), "--prompt", "hi", "--max-tokens", "2", "--system-prompt", "Be brief.")
    assert code == 0 and "system prompt is not used" not in err, err


def test_the_raw_prompt_notice_is_one_warning_for_many_prompts(tiny):
    import warnings

    from mlx_lm import load

    _, tok = load(str(tiny))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # the count is the package's, not Python's once-per-line rule
        assert [apply_chat_template(tok, p) for p in ("a", "b", "c")] == ["a", "b", "c"]
        assert apply_chat_template(tok, "d", use_template=False) == "d"
        _, other = load(str(tiny))
        assert apply_chat_template(other, "e") == "e"
    assert [str(w.message) for w in seen] == [RAW_PROMPT_NOTICE] * 2


@pytest.mark.parametrize("raw", [b"\xff\xfe\x00\x80garbage", bytes(range(256)) * 4])
def test_random_bytes_on_stdin(capsys, monkeypatch, raw):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
    code, err = gen(capsys, "--model", "/nonexistent", "--prompt", "-")
    assert code == 1 and "stdin is not UTF-8 text" in one_error_line(err)


@pytest.mark.parametrize("model", ["nonexistent", "tiny"])
@pytest.mark.parametrize("flags, words", [
    (("--prompt", "\udcff\udcfe hi"), "--prompt is not UTF-8 text (byte 0xff at character 0)"),
    (("--prompt", "hi", "--system-prompt", "ok \udced\udca0\udc80"),
     "--system-prompt is not UTF-8 text (byte 0xed at character 3)"),
])
def test_arguments_that_are_not_utf8_are_named_before_loading(tiny, capsys, model, flags, words):
    """A non-UTF-8 argument (lone surrogates by Python's surrogateescape) reached the tokenizer: a TypeError
    traceback with --ignore-chat-template, else an error blaming the chat template, both after loading."""
    path = str(tiny) if model == "tiny" else "/nonexistent"
    code, err = gen(capsys, "--model", path, "--ignore-chat-template", "--max-tokens", "2", *flags)
    assert code == 1 and words in one_error_line(err)


# -- flags ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (("--temp", "-1"), "--temp must be a number >= 0"),
    (("--temp", "nan"), "--temp must be a number >= 0"),
    (("--top-p", "2"), "--top-p must be in (0, 1]"),
    (("--top-p", "0"), "--top-p must be in (0, 1]"),
    (("--min-p", "1.5"), "--min-p must be in [0, 1]"),
    (("--top-k", "-3"), "--top-k must be an integer >= 0"),
    (("--kv-bits", "99"), "--kv-bits must be one of"),
    (("--kv-bits", "7"), "--kv-bits must be one of"),
    (("--kv-bits", "1"), "--kv-bits must be one of 2, 3, 4, 5, 6, 8, got 1"),
    (("--kv-bits", "4", "--kv-group-size", "48"), "--kv-group-size must be one of 32, 64, 128"),
    (("--kv-bits", "4", "--quantized-kv-start", "-1"), "--quantized-kv-start must be an integer >= 0"),
    (("--max-kv-size", "0"), "--max-kv-size must be an integer >= 1"),
    (("--seed", "-1"), "--seed must be an integer in [0, 2**64)"),
    (("--window", "0"), "--window must be an integer from 1 to 1,000,000"),
    (("--window", str(10**20)), "--window must be an integer from 1 to 1,000,000"),
    (("--hysteresis", "nan"), "--hysteresis must be a number >= 0"),
    (("--min-gear-duration", "0"), "--min-gear-duration must be an integer >= 1"),
    (("--thresholds", "nan", "2"), "--thresholds must be finite"),
    (("--max-tokens", "0"), "--max-tokens must be positive"),
])
def test_flags_out_of_range_fail_before_loading(capsys, flags, message):
    code, err = gen(capsys, "--model", "/nonexistent/model", "--prompt", "hi", *flags)
    assert code == 1 and message in one_error_line(err)  # the flag, not the missing model


@pytest.mark.parametrize("flags, named", [
    (("--max-draft", "3"), "--max-draft sets"),
    (("--hard-max-draft", "2"), "--hard-max-draft sets"),
    (("--draft-entropy-stop", "off"), "--draft-entropy-stop sets"),
    (("--draft-gear", "mid", "--draft-scope", "attention"), "--draft-gear, --draft-scope set"),
    (("--draft-sparsity", "0.5"), "--draft-sparsity sets"),
])
@pytest.mark.parametrize("command", ["generate", "server"])
def test_drafter_flags_without_speculative_are_refused_before_loading(capsys, command, flags, named):
    """They did nothing without --speculative, without a word (the server took --draft-sparsity too)."""
    from gearbx_mlx.server import app

    main = generate.main if command == "generate" else app.main
    code = main(["--model", "/nonexistent/model", *(["--prompt", "hi"] if command == "generate" else []), *flags])
    line = one_error_line(capsys.readouterr().err)
    assert code == 1 and f"{named} the speculative drafter: add --speculative" in line, line


def test_thresholds_above_log2_v_fail_after_loading(tiny, capsys):
    code, err = gen(capsys, "--model", str(tiny), "--prompt", "hi", "--thresholds", "1", "1e300")
    line = one_error_line(err)
    assert code == 1 and "above log2(266)" in line and len(line) < 300  # no 300-digit number


def test_a_trace_path_that_is_a_directory(capsys, tmp_path):
    code, err = gen(capsys, "--model", "/nonexistent", "--prompt", "hi", "--trace", str(tmp_path))
    assert code == 1 and "is a directory" in one_error_line(err)


def test_the_library_checks_generation_options_too(tiny_llama):
    from gearbx_mlx.pipeline import stream_generate

    with pytest.raises(ValueError, match="temp must be a number >= 0"):
        next(stream_generate(tiny_llama, None, [1, 2], temp=-1.0))
    with pytest.raises(ValueError, match="kv_bits must be one of"):
        check_generation_options(kv_bits=99)
    check_generation_options(temp=0.0, top_p=1.0, min_p=0.0, top_k=0, kv_bits=4, max_kv_size=1, seed=0)


# -- traces for analyze ----------------------------------------------------------------------------------------------
HEADER = {"type": "header", "format": "gearbx-trace", "version": 1, "vocab_size": 100}
TOKEN = {"type": "token", "index": 0, "entropy": 1.0, "gear": "low", "shift": False, "step_seconds": 0.01}


@pytest.mark.parametrize("lines, message", [
    ([HEADER, {**TOKEN, "entropy": "abc"}], "'entropy' must be a number"),
    ([HEADER, {**TOKEN, "gear": 5}], "unknown gear 5"),
    ([HEADER, {**TOKEN, "gear": ["low"]}], "unknown gear"),
    ([HEADER, {**TOKEN, "shift": "yes"}], "'shift' must be true or false"),
    ([HEADER, {**TOKEN, "index": 1.5}], "'index' must be an integer"),
    ([HEADER, {**TOKEN, "step_seconds": "fast"}], "'step_seconds' must be a number"),
    ([HEADER, {**TOKEN, "text": 7}], "'text' must be text"),
    ([{**HEADER, "vocab_size": "49152"}, TOKEN], "'vocab_size' must be an integer"),
    ([{**HEADER, "vocab_size": 0}, TOKEN], "vocab_size must be >= 2"),
    ([HEADER, TOKEN, {"type": "summary", "interrupted": "no"}], "'interrupted' must be true or false"),
    ([HEADER, HEADER], "a second header"),
])
def test_traces_with_fields_of_the_wrong_type(tmp_path, capsys, lines, message):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(TraceError, match=r"t.jsonl:\d"):
        read_trace(p)
    assert analyze.main([str(p)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert message in line and str(p) in line


@pytest.mark.parametrize("value", ["turbo", 3, ["low"]])
def test_an_unknown_next_gear_is_one_error_naming_the_file_and_line(tmp_path, capsys, value):
    """Left in, such a token would silently drop out of the per-chosen-gear rows."""
    tokens = [{**TOKEN, "index": i, "next_gear": "low"} for i in range(4)]
    tokens[2]["next_gear"] = value
    tokens[3]["next_gear"] = None  # null: not known, allowed
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [HEADER, *tokens]) + "\n")
    assert analyze.main([str(p)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"{p}:4:" in line and "'next_gear' must be a gear" in line
    tokens[2]["next_gear"] = "mid"
    p.write_text("\n".join(json.dumps(x) for x in [HEADER, *tokens]) + "\n")
    assert analyze.main([str(p)]) == 0


@pytest.mark.parametrize("content", [b"\xff\xfe garbage\n", b"[" * 100_000 + b"\n", b""])
def test_traces_that_are_not_text_or_too_deep(tmp_path, capsys, content):
    p = tmp_path / "t.jsonl"
    p.write_bytes(content)
    assert analyze.main([str(p)]) == 1
    assert str(p) in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("policy, message", [
    ({"gears": "lmh", "entropy": [1.0, 2.0]}, "'entropy' must be a list of 3 numbers"),
    ({"gears": "lmh", "entropy": [1.0, "x", 2.0]}, "not a finite number"),
    ({"gears": 5}, "'gears' must be a string"),
    ({"gears": "lxh"}, "unknown gear letters"),
])
def test_evaluation_reports_with_wrong_types_in_analyze(tmp_path, capsys, policy, message):
    p = tmp_path / "eval.json"
    p.write_text(json.dumps({"format": "gearbx-eval", "traces": {"p": policy}, "text": {"windows": 1}}))
    assert analyze.main([str(p)]) == 1
    assert message in one_error_line(capsys.readouterr().err)


def test_an_evaluation_report_with_a_bad_window_count(tmp_path, capsys):
    p = tmp_path / "eval.json"
    p.write_text(json.dumps({"format": "gearbx-eval", "traces": {"p": {"gears": "lm"}}, "text": {"windows": "x"}}))
    assert analyze.main([str(p)]) == 1
    assert "text.windows must be an integer" in one_error_line(capsys.readouterr().err)


# -- evaluate ----------------------------------------------------------------------------------------------------------
def test_evaluate_out_pointing_at_a_directory_fails_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(evaluate, "load", lambda *a, **k: pytest.fail("loaded a model despite a bad --out"))
    assert evaluate.main(["--out", str(tmp_path), "--quiet"]) == 2
    assert "is a directory" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("content", [
    {"format": "gearbx-eval"},  # the right format, nothing in it
    {"format": "gearbx-eval", "comparisons": [], "policies": 5, "routing": {}},
    {"format": "gearbx-eval", "comparisons": [{"entropy": 1}], "policies": []},
    [1, 2, 3],
    {"some": "other tool's json"},
])
def test_evaluate_from_json_of_a_foreign_file(tmp_path, capsys, content):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(content))
    assert evaluate.main(["--from-json", str(p)]) == 2
    assert str(p) in one_error_line(capsys.readouterr().err)


def test_evaluate_from_json_of_binary_bytes(tmp_path, capsys):
    p = tmp_path / "r.json"
    p.write_bytes(np.random.default_rng(0).bytes(4096))
    assert evaluate.main(["--from-json", str(p)]) == 2
    assert str(p) in one_error_line(capsys.readouterr().err)


def test_resolve_model_rejects_what_is_not_a_model(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ValueError, match="is a file"):
        models.resolve_model(str(f))


@pytest.mark.parametrize("prompt, error, words", [
    ([10**6], ValueError, "token ids must lie in [0, "),
    ([-5, 3], ValueError, "token ids must lie in [0, "),
    ([2**40], ValueError, "token ids must lie in [0, "),
    ([1.5], TypeError, "must hold integers"),
    ("mx", ValueError, "token ids must lie in [0, "),
])
def test_prompt_ids_outside_the_vocabulary_are_refused(prompt, error, words):
    """An id past the embedding table went through MLX's unchecked gather (a segfault, or
    another token's row); a negative one failed in the tokenizer's decode."""
    import mlx.core as mx
    from conftest import make_tiny_llama, make_tiny_tokenizer

    import gearbx_mlx

    model, tokenizer = make_tiny_llama(), make_tiny_tokenizer()
    gearbox = gearbx_mlx.Gearbox(model)
    if prompt == "mx":
        prompt = mx.array([1, gearbox.vocab_size])
    with pytest.raises(error, match=re.escape(words)):
        gearbx_mlx.generate(model, tokenizer, prompt, gearbox, max_tokens=2)
    assert gearbx_mlx.generate(model, tokenizer, [1, 2, gearbox.vocab_size - 1], gearbox, max_tokens=2) is not None


@pytest.mark.parametrize("speculative", [None, "force"])
def test_a_top_k_as_large_as_the_vocabulary_is_refused(speculative):
    """mlx-lm's top-k partition fails past the vocabulary (``std::bad_cast`` from MLX, or the
    random state left a traced placeholder): one clear error before any forward pass."""
    from conftest import make_tiny_llama, make_tiny_tokenizer

    import gearbx_mlx

    model, tokenizer = make_tiny_llama(), make_tiny_tokenizer()
    gearbox = gearbx_mlx.Gearbox(model)
    v = gearbox.vocab_size
    for k in (v, 10**20):
        with pytest.raises(ValueError, match=re.escape(f"top_k must be below the vocabulary size ({v}), got {k}")):
            gearbx_mlx.generate(model, tokenizer, [1, 2], gearbox, max_tokens=2, temp=0.7, top_k=k,
                                speculative=speculative)
    assert gearbx_mlx.generate(model, tokenizer, [1, 2], gearbox, max_tokens=2, temp=0.7, top_k=v - 1,
                               speculative=speculative) is not None


@pytest.mark.parametrize("prompt, error, words", [
    (b"hello", TypeError, "got bytes: decode the bytes to text first"),
    (5, TypeError, "a prompt must be text (a str) or token ids"),
    (None, TypeError, "got NoneType"),
    ({"text": "hi"}, TypeError, "got dict"),
    ("mx2d", ValueError, "must be 1-D token ids, got shape (1, 2)"),
    ("mxfloat", TypeError, "must hold integers, got an array of mlx.core.float32"),
    ("npfloat", TypeError, "must hold integers, got a NumPy array of float64"),
])
def test_a_prompt_of_the_wrong_kind_is_named(prompt, error, words):
    """Bytes were read as token ids (garbled text); an int or None failed with "has no len()";
    a 2-D array was called a list."""
    import mlx.core as mx
    import numpy as np
    from conftest import make_tiny_llama, make_tiny_tokenizer

    import gearbx_mlx

    model, tokenizer = make_tiny_llama(), make_tiny_tokenizer()
    gearbox = gearbx_mlx.Gearbox(model)
    prompt = {"mx2d": mx.array([[1, 2]]), "mxfloat": mx.array([1.0, 2.0]),
              "npfloat": np.array([1.0, 2.0])}.get(prompt, prompt) if isinstance(prompt, str) else prompt
    with pytest.raises(error, match=re.escape(words)):
        gearbx_mlx.generate(model, tokenizer, prompt, gearbox, max_tokens=2)


def test_numpy_token_ids_are_a_prompt_as_in_mlx_lm():
    import mlx.core as mx
    import numpy as np
    from conftest import make_tiny_llama, make_tiny_tokenizer

    import gearbx_mlx

    model, tokenizer = make_tiny_llama(), make_tiny_tokenizer()
    gearbox = gearbx_mlx.Gearbox(model)
    want = gearbx_mlx.generate(model, tokenizer, [1, 2, 3], gearbox, max_tokens=3)
    for ids in (np.array([1, 2, 3]), np.array([1, 2, 3], dtype=np.uint16), [np.int64(1), np.int32(2), 3],
                mx.array([1, 2, 3]), (1, 2, 3)):
        assert gearbx_mlx.generate(model, tokenizer, ids, gearbox, max_tokens=3) == want


def test_a_config_changed_after_it_was_checked_is_checked_again_before_a_run():
    """``gearbox.config.window = 0`` ended in a ZeroDivisionError inside the monitor."""
    from conftest import make_tiny_llama, make_tiny_tokenizer

    import gearbx_mlx

    model, tokenizer = make_tiny_llama(), make_tiny_tokenizer()
    gearbox = gearbx_mlx.Gearbox(model)
    gearbox.config.window = 0
    with pytest.raises(ValueError, match="window must be an integer from 1"):
        gearbx_mlx.generate(model, tokenizer, [1, 2], gearbox, max_tokens=2)


def test_a_policy_given_as_a_gear_name_is_that_gear_and_anything_else_is_named():
    """``policy="low"`` (the CLI's --static-gear low) failed with an AttributeError."""
    from conftest import make_tiny_llama, make_tiny_tokenizer

    import gearbx_mlx

    model, tokenizer = make_tiny_llama(), make_tiny_tokenizer()
    gearbox = gearbx_mlx.Gearbox(model)
    out = list(gearbx_mlx.stream_generate(model, tokenizer, [1, 2], gearbox, max_tokens=3, policy="low"))
    assert [r.gear for r in out] == ["low"] * 3
    with pytest.raises(ValueError, match="unknown gear 'fast'"):
        gearbx_mlx.generate(model, tokenizer, [1, 2], gearbox, max_tokens=2, policy="fast")
    with pytest.raises(TypeError, match="policy must be a gear name"):
        gearbx_mlx.generate(model, tokenizer, [1, 2], gearbox, max_tokens=2, policy=3)


@pytest.mark.parametrize("command, argv, words", [
    ("generate", ["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ("generate", ["--bogus"], "unrecognized arguments: --bogus"),
    ("server", ["--bogus"], "unrecognized arguments: --bogus"),
    ("evaluate", ["--tokens", "x"], "argument --tokens: invalid int value"),
    ("bench", ["--rounds", "x"], "argument --rounds: invalid int value"),
    ("analyze", [], "the following arguments are required"),
    ("remote", ["--bogus"], "unrecognized arguments: --bogus"),
    ("selftest", ["--bogus"], "unrecognized arguments: --bogus"),
])
def test_a_flag_argparse_refuses_is_one_error_line(command, argv, words):
    """argparse printed its whole usage block (33 lines for generate) before its error."""
    p = subprocess.run([sys.executable, "-m", f"gearbx_mlx.{command}", *argv], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "GEARBX_NO_BLAS_PRELOAD": "1"})
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and words in p.stderr, p.stderr
    assert f"python -m gearbx_mlx.{command} --help" in p.stderr


def test_a_dtype_given_for_a_local_folder_is_said_not_to_apply(tiny, recwarn):
    """--dtype was ignored for an mlx-lm folder without a word."""
    import warnings as _warnings

    from gearbx_mlx.sources import models

    with pytest.warns(UserWarning, match="dtype float16 is not applied to"):
        assert models.resolve_model(str(tiny), dtype="float16") == str(tiny)
    with _warnings.catch_warnings():
        _warnings.simplefilter("error")
        assert models.resolve_model(str(tiny)) == str(tiny)


@pytest.mark.parametrize("mode", [None, "plain", "force"])
def test_keywords_a_loop_cannot_use_are_refused_in_every_mode(tiny, mode):
    """A keyword the loop does not know is a TypeError in routed (mlx-lm's) and speculative
    decoding alike, never dropped; mlx-lm's own keywords that drafting cannot apply are named."""
    from gearbx_mlx.generation import load
    from gearbx_mlx.pipeline import stream_generate

    model, tok, gb = load(str(tiny))
    with pytest.raises(TypeError, match="max_tokns"):
        list(stream_generate(model, tok, "abc", gb, max_tokns=3, speculative=mode))
    if mode is not None:
        with pytest.raises(ValueError, match="does not take sampler"):
            list(stream_generate(model, tok, "abc", gb, sampler=lambda x: x, speculative=mode))
    assert not gb.busy.locked() and gb.manager.gear == "high"
    assert len(list(stream_generate(model, tok, "abc", gb, max_tokens=3, speculative=mode))) == 3


def test_api_arguments_of_the_wrong_kind_are_one_clear_error(tiny):
    """What mlx-lm would take silently or fail on deep inside: a cache that is not one, or of
    another model; a prefill step of 0; mlx-lm's positional verbose where the gearbox goes; one
    calibration prompt given as a string (a prompt per character)."""
    from mlx_lm.models.cache import make_prompt_cache

    from gearbx_mlx.generation import load
    from gearbx_mlx.pipeline import stream_generate

    model, tok, gb = load(str(tiny))
    cases = [((gb,), {"prompt_cache": 5}, TypeError, "list of KV caches"),
             ((gb,), {"prompt_cache": make_prompt_cache(model)[:1]}, ValueError, "holds 1 layer caches"),
             ((gb,), {"prefill_step_size": 0}, ValueError, "prefill_step_size must be an integer >= 1"),
             ((True,), {}, TypeError, "gearbox must be a Gearbox")]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            list(stream_generate(model, tok, "abc", *args, max_tokens=2, **kwargs))
    with pytest.raises(TypeError, match="list of non-empty strings"):
        gb.calibrate(tok, prompts="one prompt")
    ok = list(stream_generate(model, tok, "abc", gb, max_tokens=2, prompt_cache=make_prompt_cache(model)))
    assert len(ok) == 2 and not gb.busy.locked()
