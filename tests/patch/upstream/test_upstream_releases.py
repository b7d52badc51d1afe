"""jagg_patch.upstream on every release of upstream's trainers since open-sourcing (as stand-ins:
tests/upstream_releases.py), each from a plain checkout: the family (a full-weight Flux file without
ema_handler is Flux, not the LoRA trainer), the known release by its token hash (no warning), the
reward file of that release, exact mode == that release's own step (gradients, returns, RNG draws,
reward file), JAGG == an independent float64 reference built from its own grpo_one_step, the
counts, and revert. The token hash is the same on every Python."""
import ast
import glob
import json
import os
import shutil
import subprocess
import warnings

import pytest
import torch

from jagg_patch.seams import UPSTREAM_RELEASES
from jagg_patch.upstream import apply, load_trainer, revert, token_hash
from jagg_patch.upstream.fingerprint import nearest_release
from jagg_patch.upstream import tokenhash
from upstream_harness import (B, FAMILY, Standin, in_tmp, jagg_step_and_its_draw, one_rank_group, standins_known,  # noqa: F401
                              reference_jagg_gradient, rel, standin_file)
from upstream_releases import RECORDED_AS, RELEASES, release, standin_releases, write_release

NAMES = [name for name, *_ in RELEASES]


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """The known-release table with the stand-ins' token hashes in place of the real ones."""
    folder = tmp_path_factory.mktemp("releases")
    hashes = {name: token_hash(load_trainer(write_release(folder / name.replace("@", "_"), name)).train_one_step)
              for name in NAMES}
    return hashes, standin_releases(hashes)


def test_the_stand_ins_group_into_releases_as_the_recorded_hashes_do(known):
    """Releases that share a recorded token hash share the stand-in's (the LoRA trainer's train_one_step
    is token for token Flux bbf5278's), and no two recorded hashes share one."""
    hashes, table = known
    for a in NAMES:
        for b in NAMES:
            assert (hashes[a] == hashes[b]) == (RECORDED_AS[a] == RECORDED_AS[b]), (a, b)
    assert [r.commits for r in table] == [r.commits for r in UPSTREAM_RELEASES]


def test_the_recorded_releases_are_the_references_table():
    one = ("./reward.txt",)
    assert {(r.token_hash, r.family, r.reward_files) for r in UPSTREAM_RELEASES} == {
        ("ac4b353cdcc7f665", "flux", one), ("289a6c265fedb7c7", "flux", one),
        ("c7a2fcac1dc57e74", "flux", ("./hps_reward.txt",)), ("465f923956336644", "qwenimage", one),
        ("ff2ee0b57cf90003", "qwenimage_edit", one), ("127e437113921902", "wan", one),
        ("fae5119519022108", "hunyuan", ("./vq_reward.txt", "./mq_reward.txt")),
        ("f6253f76230e7ee4", "skyreels_i2v", one)}
    assert len(by_hash := {r.token_hash: r for r in UPSTREAM_RELEASES}) == len(UPSTREAM_RELEASES)
    assert len(by_hash["fae5119519022108"].parameters) == 10 and len(by_hash["f6253f76230e7ee4"].parameters) == 13
    by_hash = {r.token_hash: r for r in UPSTREAM_RELEASES}
    assert "ema_handler" in by_hash["ac4b353cdcc7f665"].parameters
    assert "ema_handler" not in by_hash["289a6c265fedb7c7"].parameters + by_hash["c7a2fcac1dc57e74"].parameters


@pytest.mark.parametrize("name", ["flux@9ac72b4", "flux@bbf5278", "flux@93ec253"])
def test_an_unknown_source_names_the_nearest_recorded_release(name, tmp_path):
    """Against the real table (the stand-ins' own hashes are not in it): by parameter list, then reward file."""
    module = load_trainer(write_release(tmp_path / "checkout", name))
    assert nearest_release(module.train_one_step, "flux").token_hash == RECORDED_AS[name]


@pytest.mark.parametrize("name", NAMES)
def test_each_release_is_known_and_runs_exactly_as_its_own_step(name, known, cache_dir, tmp_path, capsys):
    _, key, commits, _ = release(name)
    standin = Standin(key, cache_dir, tmp_path, path=write_release(tmp_path / "checkout", name))
    (loss, norm), grads, rng, weights = standin.step()
    upstream_printed = capsys.readouterr().out
    reward_files = {"flux@93ec253": ("./hps_reward.txt",)}.get(
        name, ("./vq_reward.txt", "./mq_reward.txt") if key == "hunyuan" else ("./reward.txt",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a known release: no warning
        assert apply(standin.module, mode="exact", releases=known[1], restated=True) == FAMILY[key]
    trainer = standin.module.train_one_step.jagg_trainer
    assert trainer.release.token_hash == known[0][name] and trainer.reward_files == reward_files
    if key == "flux":   # a full-weight Flux file is never called the LoRA trainer, bbf5278's neither
        assert "lora" not in trainer.describe() and trainer.release_text().startswith("train_grpo_flux.py ")
    try:
        (loss2, norm2), grads2, rng2, weights2 = standin.step()
        stats = standin.module.train_one_step.last_stats
    finally:
        revert(standin.module)
    ours_printed = capsys.readouterr().out
    assert not hasattr(standin.module.train_one_step, "jagg_trainer")   # revert: upstream's own function again
    assert len(grads) == len(grads2) == 2 and all(rel(g2, g) < 1e-12 for g, g2 in zip(grads, grads2))
    assert torch.equal(rng, rng2) and abs(loss2 - loss) < 1e-14 and abs(norm2 - norm) <= 1e-12 * norm
    assert rel(weights2, weights) < 1e-12
    # the release's own reward files: one line from upstream's step, one from the restated one, the same
    for path in reward_files:
        first, second = open(path).read().splitlines()
        assert first == second
    others = {"./reward.txt", "./hps_reward.txt", "./vq_reward.txt", "./mq_reward.txt"} - set(reward_files)
    assert not any(os.path.exists(other) for other in others)
    label = {"flux@93ec253": "hps reward", "hunyuan@9ac72b4": "vq/mq reward", "hunyuan@be8cf11": "vq/mq reward"}.get(
        name, "reward")
    assert f"\n{label} " in "\n" + upstream_printed and f"\n{label} " in "\n" + ours_printed
    assert stats["transformer_backwards"] == B * int(7 * 0.6) and stats["transformer_forwards_nograd"] == B * 8


@pytest.mark.parametrize("name", ["flux@2145e4f", "flux@93ec253", "flux_lora@ff7bee1"])
def test_each_release_runs_jagg_as_the_independent_reference(name, known, cache_dir, tmp_path):
    """W 4 over the 4 trained transitions of each sample, against float64 autograd of the release's own
    grpo_one_step (its flux_step: before 9ac72b4 without the log-density's constant terms)."""
    _, key, _, _ = release(name)
    standin = Standin(key, cache_dir, tmp_path, "--gradient_accumulation_steps", B,
                      path=write_release(tmp_path / "checkout", name))
    adapter_grad, stats, result, steps = jagg_step_and_its_draw(standin, 4, window=4, jagg_frac=1.0, backward="split",
                                                                reuse="off", releases=known[1])
    r = result[0].float()
    advantages = (r - r.mean()) / (r.std() + 1e-8)
    reference = reference_jagg_gradient(standin, result, steps, advantages, B * 4)
    assert rel(adapter_grad, reference) < 1e-10
    assert (stats["jagg_groups"], stats["transformer_backwards"], stats["backward_calls"]) == (B, 2 * B, 2 * B)


# ---------------------------------------------------------------- the token hash on every Python

def _other_pythons():
    found = {os.path.realpath(p) for p in glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3"))}
    found |= {os.path.realpath(p) for p in map(shutil.which, ("python3.12", "python3.13", "python3.14"))
              if p and "/shims/" not in p}   # a pyenv shim answers only for the selected version
    return sorted(found)


_HASH_IN = """
import ast, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("tokenhash", sys.argv[1])
th = importlib.util.module_from_spec(spec); spec.loader.exec_module(th)
found = {}
for path in sys.argv[2:]:
    text = open(path).read()
    node = next(n for n in ast.parse(text).body if getattr(n, "name", None) == "train_one_step")
    source = "".join(text.splitlines(keepends=True)[node.lineno - 1:node.end_lineno])
    found[path] = [th.hash_tokens(th.source_tokens(source)), sys.version_info[:2]]
print(json.dumps(found))
"""


def test_the_token_hash_is_the_same_on_every_python(tmp_path):
    """The stand-ins' train_one_step (f-strings included) and a function of f-strings of every kind hash
    the same under this Python and every other one installed (3.12 tokenizes f-strings apart)."""
    pythons = _other_pythons()
    if not pythons:
        pytest.skip("no Python >= 3.12 beside this one to compare with")
    extra = tmp_path / "fstrings.py"
    extra.write_text('def train_one_step(x, w, p):\n    # a comment\n    y = {"a": f\'{x:{w}.{p}f}\'}  # trailing\n'
                     '    print(f"{x.mean().item():.4f}\\n", f\'a{{b}}c{x!r:>{w}}\', rf"""multi\nline {x} end""",\n'
                     '          f"{x=}", f"{\'nested\' + f\'{x}\'}", "plain" f"{x}")\n    return f"""{x}\n{{}}"""\n')
    files = [standin_file(k) for k in ("flux", "qwenimage_edit", "wan", "hunyuan", "skyreels")] + [str(extra)]
    here = {f: tokenhash.hash_tokens(tokenhash.source_tokens(
        "".join(open(f).read().splitlines(keepends=True)[n.lineno - 1:n.end_lineno])))
        for f in files for n in ast.parse(open(f).read()).body if getattr(n, "name", None) == "train_one_step"}
    assert here[files[0]] == token_hash(load_trainer(files[0]).train_one_step)   # from the file = from the function
    for python in pythons:
        run = subprocess.run([python, "-c", _HASH_IN, tokenhash.__file__, *files], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr
        theirs = json.loads(run.stdout)
        assert {f: h for f, (h, _) in theirs.items()} == here, (python, theirs)
