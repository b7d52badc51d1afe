"""Adding a model family is one package and one registry line: a throwaway family, written here into
a temporary package, is trained, evaluated, built into a digits world and preprocessed by the
repository's own entry points, which find every part of it through dancegrpo.models.registry."""
import json
import os
import sys
import textwrap

import pytest
import torch

PACKAGE = "toyfamily_pkg"
FILES = {
    "__init__.py": """
        from .model import ToyFamily
        FAMILY = ToyFamily
    """,
    "model.py": """
        from dancegrpo.models.flux import FluxFamily

        class ToyFamily(FluxFamily):
            name = "toy"
            predict_calls = 0

            def predict(self, transformer, latents, timesteps, cond):
                type(self).predict_calls += 1
                return super().predict(transformer, latents, timesteps, cond)
    """,
    "embeddings.py": """
        from dancegrpo.models.flux.embeddings import save_embeddings, write_embeddings  # noqa: F401
    """,
    "presets.py": """
        from dancegrpo.models.flux.presets import PRESETS as FLUX
        # Flux's tiny preset with 6 text tokens: the toy's own, told apart by its files.
        PRESETS = {"tiny": dict(FLUX["tiny"], text=dict(FLUX["tiny"]["text"], tokens=6))}
    """,
    "digits.py": """
        from dancegrpo.models.flux.digits import DigitsWorld as FluxWorld
        from .model import ToyFamily

        class DigitsWorld(FluxWorld):
            family = ToyFamily

        WORLDS = {"digits": DigitsWorld}
    """,
    "preprocess.py": """
        import torch
        from dancegrpo.models.flux.preprocess import SUBFOLDERS

        class ToyEncoder:   # fixed tensors in Flux's layout, 6 text tokens: no text encoder to load
            description, subfolders, components, hint = "toy", SUBFOLDERS, (), ""
            default_max_sequence_length = 6

            @staticmethod
            def check_args(args):
                return None

            @staticmethod
            def load(args, device, dtype):
                return None

            @staticmethod
            def encode(state, prompts, args):
                return [{"prompt_embeds": torch.full((6, 32), float(len(p))), "pooled_prompt_embeds": torch.zeros(32),
                         "text_ids": torch.zeros(3)} for p in prompts]

            @staticmethod
            def index_fields(paths):
                return {}

        ENCODER = ToyEncoder
    """,
    "train.py": """
        from dancegrpo.args import build_parser as _build_parser
        from dancegrpo.trainer import trainer_entry
        from . import FAMILY

        policy_update, select_train_steps, train_one_step, main = trainer_entry(__name__)

        def build_parser():
            return _build_parser("toy", "DanceGRPO training of the toy family.")
    """,
}


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    from dancegrpo.models.registry import register_family, unregister_family
    root = tmp_path / "pkgs" / PACKAGE
    root.mkdir(parents=True)
    for name, text in FILES.items():
        (root / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    register_family("toy", PACKAGE)   # the one registry line
    yield sys.modules.get(PACKAGE) or __import__(PACKAGE)
    unregister_family("toy")
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def test_a_family_added_as_one_package_runs_everywhere(toy_family, make_args, cache_dir, tmp_path):
    from dancegrpo import evaluate, presets
    from dancegrpo.digits.build import build
    from dancegrpo.models.registry import family_names
    from dancegrpo.preprocess.__main__ import main as preprocess_main
    toy = toy_family.FAMILY
    assert "toy" in family_names() and presets.preset_names("toy") == ["tiny"]

    # Training: its preset (its own embedding files) and its predict.
    args = make_args("--max_train_steps", 1, "--train_batch_size", 2, "--num_generations", 2,
                     "--gradient_accumulation_steps", 4, "--sample_batch_size", 4, "--update_batch_size", 2,
                     module=f"{PACKAGE}.train")
    items = json.load(open(args.data_json_path))
    embed = torch.load(os.path.join(os.path.dirname(args.data_json_path), "prompt_embed",
                                    items[0]["prompt_embed_path"]))
    assert embed.shape[0] == 6 and "toy-tiny" in args.pretrained_model_name_or_path
    history = sys.modules[f"{PACKAGE}.train"].main(args)
    assert len(history) == 1 and toy.predict_calls > 0

    # Evaluation: --family toy is a choice, its class loads and samples.
    before = toy.predict_calls
    evaluate.main(["--family", "toy", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
                   str(tmp_path / "eval"), "--device", "cpu", "--max_prompts", "1", "--sampling_steps", "2"])
    assert json.load(open(tmp_path / "eval" / "preset-tiny" / "summary.json"))["family"] == "toy"
    assert toy.predict_calls > before

    # The digits build: its DigitsWorld, its family's predict.
    before = toy.predict_calls
    record = build("toy", str(tmp_path / "digits"), vae_steps=1, transformer_steps=1, log=lambda m: None,
                   max_images=10)
    assert record["family"] == "toy" and toy.predict_calls > before
    assert (tmp_path / "digits" / "transformer" / "config.json").is_file()

    # Preprocessing: its encoder, through the generic entry point; the trainer's dataset reads the files.
    from dancegrpo.utils.data import PromptEmbeddingDataset
    (tmp_path / "prompts.txt").write_text("a cat\nthe digit seven\n")
    out = tmp_path / "embeddings"
    entries = preprocess_main(["--family", "toy", "--model_path", str(tmp_path), "--prompt_dir",
                               str(tmp_path / "prompts.txt"), "--output_dir", str(out)])
    assert [e["caption"] for e in entries] == ["a cat", "the digit seven"]
    item = PromptEmbeddingDataset(str(out / "videos2caption.json"), toy.embedding_fields)[1]
    assert item["encoder_hidden_states"].shape == (6, 32) and float(item["encoder_hidden_states"][0, 0]) == 15.0


def test_an_unknown_family_is_refused_naming_the_known_ones():
    from dancegrpo.errors import ConfigError
    from dancegrpo.models.registry import family_part, register_family
    with pytest.raises(ConfigError, match=r"unknown model family 'nope'; known: \['flux', 'qwenimage'\]"):
        family_part("nope")
    with pytest.raises(ValueError, match="already 'dancegrpo.models.flux'"):
        register_family("flux", "somewhere.else")
