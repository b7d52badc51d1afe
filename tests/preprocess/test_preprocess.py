"""Preprocessing: prompt file -> embeddings (real diffusers encode_prompt on tiny encoders) ->
dataset -> trainer; resume after an interruption; bad input."""
import json
import os
import subprocess
import sys

import pytest
import torch

from dancegrpo.args import parse_args
from dancegrpo.utils.data import PromptEmbeddingDataset
from dancegrpo.models.flux import FluxFamily
from dancegrpo.models.qwenimage import QwenImageFamily
from dancegrpo.preprocess import common, flux as pre_flux, qwenimage as pre_qwen

from tiny_text_encoders import build_flux_text_folder, build_qwen_text_folder
from helpers import REPO_ROOT

ROOT = REPO_ROOT
PROMPTS = ["a red fox sitting in fresh snow", "a lighthouse on a rocky coast at sunset",
           "a bowl of ramen with a soft boiled egg", "an old tram in a narrow street",
           "zzz unknown words here", "a cat"]


@pytest.fixture(scope="session")
def qwen_text(tmp_path_factory):
    return build_qwen_text_folder(str(tmp_path_factory.mktemp("qwen_text")))


@pytest.fixture(scope="session")
def flux_text(tmp_path_factory):
    return build_flux_text_folder(str(tmp_path_factory.mktemp("flux_text")))


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    lines = []
    for i, p in enumerate(PROMPTS):
        lines += [p, "", "   "] if i % 2 else [p]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _read_index(out):
    with open(os.path.join(out, common.INDEX_NAME)) as f:
        return json.load(f)


def test_default_output_folders_differ():
    a = common.build_parser("flux", "", 512).parse_args(["--model_path", "m", "--prompt_dir", "p"]).output_dir
    b = common.build_parser("qwenimage", "", 1024).parse_args(["--model_path", "m", "--prompt_dir", "p"]).output_dir
    assert a != b


def test_qwen_preprocess_matches_pipeline_and_trains(qwen_text, prompt_file, tmp_path, preset_cache):
    out = str(tmp_path / "emb")
    entries = pre_qwen.main(["--model_path", qwen_text, "--prompt_dir", prompt_file, "--output_dir", out,
                             "--max_sequence_length", "16", "--batch_size", "4"])
    assert [e["caption"] for e in entries] == PROMPTS and _read_index(out) == entries
    lengths = [e["original_length"] for e in entries]
    assert len(set(lengths)) > 2 and max(lengths) <= 16

    # Same numbers as diffusers' QwenImagePipeline.encode_prompt on one prompt (no padding there).
    from diffusers import QwenImagePipeline
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    pipe = QwenImagePipeline(scheduler=None, vae=None, transformer=None,
                             text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_text, subfolder="text_encoder"),
                             tokenizer=AutoTokenizer.from_pretrained(qwen_text, subfolder="tokenizer"))
    ds = PromptEmbeddingDataset(os.path.join(out, common.INDEX_NAME), QwenImageFamily.embedding_fields)
    for i in (0, 4):
        with torch.no_grad():
            ref, _ = pipe.encode_prompt(PROMPTS[i], device=torch.device("cpu"), max_sequence_length=16)
        item = ds[i]
        n = lengths[i]
        assert ref.shape[1] == n and item["encoder_hidden_states"].shape == (16, 32)
        torch.testing.assert_close(item["encoder_hidden_states"][:n], ref[0], atol=1e-5, rtol=1e-4)
        assert item["encoder_hidden_states"][n:].abs().sum() == 0
        assert item["encoder_hidden_states_mask"].tolist() == [1] * n + [0] * (16 - n)

    # Trainer round trip: the tiny preset's models with these embeddings.
    from dancegrpo import train_grpo_qwenimage as tq
    args = parse_args(tq.build_parser(), [
        "--preset", "tiny", "--cache_dir", preset_cache, "--output_dir", str(tmp_path / "run"),
        "--data_json_path", os.path.join(out, common.INDEX_NAME), "--max_train_steps", "1",
        "--train_batch_size", "3", "--num_generations", "2", "--gradient_accumulation_steps", "6"])
    history = tq.main(args)
    assert len(history) == 1 and history[0]["samples"] == 6


def test_flux_preprocess_matches_pipeline_and_trains(flux_text, prompt_file, tmp_path, preset_cache):
    out = str(tmp_path / "emb")
    entries = pre_flux.main(["--model_path", flux_text, "--prompt_dir", prompt_file, "--output_dir", out,
                             "--max_sequence_length", "8", "--batch_size", "4"])
    assert [e["caption"] for e in entries] == PROMPTS
    ds = PromptEmbeddingDataset(os.path.join(out, common.INDEX_NAME), FluxFamily.embedding_fields)
    item = ds[2]
    assert item["encoder_hidden_states"].shape == (8, 32) and item["pooled_prompt_embeds"].shape == (32,)
    # Upstream's layout: one [3] row per prompt, which upstream's trainer repeats to [T, 3].
    assert item["text_ids"].shape == (3,)
    from diffusers import FluxPipeline
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel
    pipe = FluxPipeline(scheduler=None, vae=None, transformer=None,
                        text_encoder=CLIPTextModel.from_pretrained(flux_text, subfolder="text_encoder"),
                        tokenizer=AutoTokenizer.from_pretrained(flux_text, subfolder="tokenizer"),
                        text_encoder_2=T5EncoderModel.from_pretrained(flux_text, subfolder="text_encoder_2"),
                        tokenizer_2=AutoTokenizer.from_pretrained(flux_text, subfolder="tokenizer_2"))
    with torch.no_grad():
        embeds, pooled, ref_text_ids = pipe.encode_prompt(PROMPTS[2], prompt_2=None, max_sequence_length=8)
    # What upstream's trainer does with the file: load the row, repeat it to [T, 3].
    upstream_ids = torch.load(os.path.join(out, "text_ids", entries[2]["text_ids"]), weights_only=True)
    torch.testing.assert_close(upstream_ids.repeat(8, 1), ref_text_ids.to(upstream_ids.dtype))
    torch.testing.assert_close(item["encoder_hidden_states"], embeds[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(item["pooled_prompt_embeds"], pooled[0], atol=1e-5, rtol=1e-4)

    from dancegrpo import train_grpo_flux as tf
    args = parse_args(tf.build_parser(), [
        "--preset", "tiny", "--cache_dir", preset_cache, "--output_dir", str(tmp_path / "run"),
        "--data_json_path", os.path.join(out, common.INDEX_NAME), "--max_train_steps", "1",
        "--train_batch_size", "3", "--num_generations", "2", "--gradient_accumulation_steps", "6"])
    assert len(tf.main(args)) == 1


def test_interrupted_preprocessing_resumes(qwen_text, prompt_file, tmp_path, monkeypatch):
    out = str(tmp_path / "emb")
    argv = ["--model_path", qwen_text, "--prompt_dir", prompt_file, "--output_dir", out,
            "--max_sequence_length", "16", "--batch_size", "2"]
    encoded = []
    real_encode = pre_qwen.QwenImageEncoder.encode
    monkeypatch.setattr(pre_qwen.QwenImageEncoder, "encode",
                        staticmethod(lambda state, prompts, args: encoded.extend(prompts) or real_encode(state, prompts, args)))
    real_save, calls = torch.save, []

    def crashing_save(obj, f, *a, **k):  # the 7th file write dies half-way (disk full, kill, ...)
        calls.append(f)
        if len(calls) == 7:
            with open(f, "wb") as h:
                h.write(b"PK\x03\x04 half a file")
            raise OSError("simulated crash while writing")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError, match="simulated crash"):
        pre_qwen.main(argv)
    monkeypatch.setattr(torch, "save", real_save)
    assert not os.path.exists(os.path.join(out, common.INDEX_NAME))  # the index is written last
    finished = 0
    for sub in ("prompt_embed", "prompt_attention_mask"):
        for name in os.listdir(os.path.join(out, sub)):
            assert name.endswith(".pt"), name  # no temp file left under any name
            torch.load(os.path.join(out, sub, name), weights_only=True)  # and none is corrupt
            finished += 1
    assert finished == 6  # 3 prompts x 2 files written before the crash
    # A killed process leaves its temp file behind: the re-run removes it.
    stale = os.path.join(out, "prompt_embed", common.item_name(5, PROMPTS[5]) + ".tmp-99999")
    open(stale, "wb").write(b"junk")

    encoded.clear()
    entries = pre_qwen.main(argv)
    assert encoded == PROMPTS[3:]  # finished prompts are not redone
    assert [e["caption"] for e in entries] == PROMPTS and not os.path.exists(stale)
    encoded.clear()
    assert pre_qwen.main(argv) == entries and encoded == []  # a third run does nothing

    fresh = str(tmp_path / "fresh")
    pre_qwen.main(argv[:5] + [fresh] + argv[6:])
    assert _read_index(fresh) == entries
    for e in entries:
        for sub, field in (("prompt_embed", "prompt_embed_path"), ("prompt_attention_mask", "prompt_attention_mask")):
            a = torch.load(os.path.join(out, sub, e[field]), weights_only=True)
            b = torch.load(os.path.join(fresh, sub, e[field]), weights_only=True)
            torch.testing.assert_close(a, b)


def test_edited_prompt_is_reencoded(qwen_text, tmp_path):
    pf = tmp_path / "p.txt"
    pf.write_text("a red fox\na cat\n")
    argv = ["--model_path", qwen_text, "--prompt_dir", str(pf), "--output_dir", str(tmp_path / "o"),
            "--max_sequence_length", "16"]
    pre_qwen.main(argv)
    pf.write_text("a red fox\na dog in snow\n")
    entries = pre_qwen.main(argv)
    assert [e["caption"] for e in entries] == ["a red fox", "a dog in snow"]
    assert entries[1]["original_length"] == 4 + 5  # 4 words + the template tail


@pytest.mark.parametrize("case", ["empty_prompts", "missing_prompts", "missing_model", "incomplete_model"])
def test_bad_input_names_the_fix(case, qwen_text, tmp_path, capsys):
    pf = tmp_path / "p.txt"
    pf.write_text("\n  \n" if case == "empty_prompts" else "a cat\n")
    model = qwen_text
    if case == "missing_model":
        model = str(tmp_path / "nowhere")
    if case == "incomplete_model":
        model = str(tmp_path / "partial")
        os.makedirs(os.path.join(model, "tokenizer"))
    prompts = str(tmp_path / "none.txt") if case == "missing_prompts" else str(pf)
    with pytest.raises(SystemExit) as err:
        pre_qwen.main(["--model_path", model, "--prompt_dir", prompts, "--output_dir", str(tmp_path / "o")])
    assert err.value.code != 0
    msg = capsys.readouterr().err
    expected = {"empty_prompts": "one prompt per line", "missing_prompts": "does not exist",
                "missing_model": "huggingface-cli download", "incomplete_model": "text_encoder/"}[case]
    assert expected in msg


@pytest.mark.slow
def test_torchrun_two_ranks(qwen_text, prompt_file, tmp_path):
    out = str(tmp_path / "emb")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "dancegrpo.preprocess.qwenimage", "--model_path", qwen_text, "--prompt_dir", prompt_file,
           "--output_dir", out, "--max_sequence_length", "16"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr[-3000:]
    entries = _read_index(out)
    assert [e["caption"] for e in entries] == PROMPTS
    assert len(os.listdir(os.path.join(out, "prompt_embed"))) == len(PROMPTS)
