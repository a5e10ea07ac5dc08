"""The real workload: the standard library's source as a byte corpus, the small GPT, the learning-rate
schedule, what evaluation reports for a sequence model and the checks on bad input (runs of the GPT on the
2-process cluster and from the CLI: tests/cluster/test_text_workload_cluster.py)."""
from __future__ import annotations

import math
import sys

import pytest
import torch

import workbench
from workbench import text
from workbench.data import BuiltinData
from workbench.errors import ConfigError
from workbench.evaluation import evaluate, held_out_text
from workbench.job import cross_entropy
from workbench.models import GPT, GPT_SIZES
from workbench.schedule import lr_factor

from helpers import TEXT_SLICE as SLICE, text_job


# --- the corpus ------------------------------------------------------------------------------------------


def test_the_split_is_by_file_and_fixed_by_its_path():
    files = text.corpus_files()
    held = [f for f in files if text.held_out(f)]
    assert 0.05 < len(held) / len(files) < 0.15  # about one file in ten
    assert all(text.held_out(f) for f in held) and not any(text.held_out(f) for f in set(files) - set(held))
    assert not any(part in text.SKIPPED_FOLDERS for f in files for part in f.split("/")[:-1])
    corpus = text.load_corpus()
    info = corpus.info
    assert info["python"] == sys.version.split()[0] and info["files"] == len(files)
    assert info["eval_files"] == len(held) and info["train_files"] == len(files) - len(held)
    assert info["train_bytes"] == len(corpus.train) > 5_000_000 and info["eval_bytes"] == len(corpus.eval)
    # The held-out text is the held-out files, whole, in path order.
    root = text.stdlib_folder()
    assert bytes(corpus.eval[:2000].tolist()) == b"".join((root / f).read_bytes() for f in held[:50])[:2000]


def test_a_slice_keeps_the_first_bytes_and_has_its_own_hash():
    whole, part = text.load_corpus(), text.load_corpus(SLICE)
    assert len(part.train) == SLICE and len(part.eval) == SLICE // text.HELD_OUT_EVERY
    assert torch.equal(part.train, whole.train[:SLICE])
    assert part.info["sha256"] != whole.info["sha256"]


def test_windows_are_inputs_and_the_same_bytes_one_further():
    tokens = torch.arange(100, dtype=torch.uint8)
    windows = text.windows(tokens, context=8)
    assert len(windows) == 12  # (100 - 1) // 8
    inputs, targets = windows.batch(torch.tensor([0, 3]))
    assert inputs.dtype == torch.int64 and inputs.tolist()[1] == list(range(24, 32))
    assert targets.tolist()[1] == list(range(25, 33))
    spread = text.windows(tokens, context=8, count=3)
    assert len(spread) == 3 and spread.starts.tolist() == [0, 48, 88]
    assert text.windows(tokens, 8, count=50).starts is None  # asked for more than there are: every window


# --- the model, the loss, the schedule, the evaluation ---------------------------------------------------------


def test_the_gpt_is_causal_tied_and_counts_its_flops():
    torch.manual_seed(0)
    model = workbench.gpt("gpt-test")()
    assert model.head.weight is model.token_embedding.weight
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, 256)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)  # no position sees a later one
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    size = GPT_SIZES["gpt-test"]
    parameters = sum(p.numel() for p in model.parameters()) - size.positions * size.width
    assert model.flops_per_token(64) == 6 * parameters + 12 * size.layers * size.width * 64
    mini = sum(p.numel() for p in workbench.gpt("gpt-mini")().parameters())
    assert 0.7e6 < mini < 1.2e6  # about a million: trains on two CPU cores in minutes


def test_cross_entropy_takes_a_sequence_models_scores_classes_last():
    scores, targets = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    expected = torch.nn.functional.cross_entropy(scores.reshape(15, 7), targets.reshape(15))
    assert torch.allclose(cross_entropy(scores, targets), expected)
    flat, labels = torch.randn(4, 7), torch.randint(0, 7, (4,))  # a classifier's: torch's own
    assert torch.allclose(cross_entropy(flat, labels), torch.nn.functional.cross_entropy(flat, labels))


def test_lr_factor_warms_up_then_decays_along_a_cosine():
    assert [lr_factor(s, 100, "cosine", 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 100, "cosine", 4) == 1.0
    assert lr_factor(99, 100, "cosine", 4, 0.1) == pytest.approx(0.1)
    middle = 4 + (100 - 4 - 1) / 2
    assert lr_factor(int(middle), 100, "cosine", 4, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 47 / 95)))
    assert lr_factor(150, 100, "cosine", 4, 0.1) == pytest.approx(0.1)  # past the end: stays at the floor
    assert lr_factor(50, 100, "constant", 10) == 1.0 and lr_factor(0, 100, "constant", 0) == 1.0


def test_evaluation_of_a_sequence_model_reports_bits_per_char_and_next_token_accuracy():
    torch.manual_seed(0)
    model = workbench.gpt("gpt-test")()
    data = text.windows(text.load_corpus(SLICE).eval, context=32, count=20)
    result = evaluate(model, data, cross_entropy, batch_size=8)
    assert result["samples"] == 20 and "accuracy" not in result
    assert result["bits_per_char"] == pytest.approx(result["loss"] / math.log(2))
    assert 7.0 < result["bits_per_char"] < 9.0  # an untrained model: about 8 bits a byte
    inputs, targets = data.batch(torch.arange(20))
    with torch.no_grad():
        expected = (model(inputs).argmax(-1) == targets).float().mean().item()
    assert result["token_accuracy"] == pytest.approx(expected)
    assert "bits/char" in held_out_text({**result, "step": 5}) and "at step 5" in held_out_text({**result, "step": 5})


# --- bad input ---------------------------------------------------------------------------------------------


def test_bad_input_is_refused_naming_the_parameter():
    with pytest.raises(ConfigError, match=r"context.*100.*at most 64"):
        text_job(data=workbench.stdlib_text(context=100, limit_bytes=SLICE)).prepare()
    with pytest.raises(ConfigError, match=r"model.*vocabulary of 128.*at least 256"):
        text_job(model=workbench.gpt("gpt-test", vocabulary=128)).prepare()
    with pytest.raises(ConfigError, match=r"data.*windows of 64 bytes.*at least one batch"):
        text_job(data=workbench.stdlib_text(context=64, limit_bytes=1000)).prepare()
    with pytest.raises(ConfigError, match="lr_schedule"):
        text_job(lr_schedule="linear").prepare()
    with pytest.raises(ConfigError, match="warmup_steps"):
        text_job(warmup_steps=-1).prepare()
    with pytest.raises(ConfigError, match="context"):
        workbench.stdlib_text(context=0)
    with pytest.raises(ConfigError, match="model.*gpt-huge"):
        workbench.gpt("gpt-huge")


def test_the_prepared_job_names_its_corpus():
    prepared = text_job().prepare()
    assert isinstance(prepared.train, BuiltinData)
    info = prepared.data_info
    assert info["name"] == "stdlib-text" and info["context"] == 64 and info["limit_bytes"] == SLICE
    assert info["python"] == sys.version.split()[0] and info["train_bytes"] == SLICE and len(info["sha256"]) == 16
