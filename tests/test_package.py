"""The repository installs as a package (pyproject.toml): both packages, their data, and entry
points that run from any folder, not only from the repository root."""
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_installed_package_runs_from_any_folder(tmp_path):
    src, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "cache_dir", "outputs", "runs", "build",
                                                             "*.egg-info", "__pycache__", ".pytest_cache"))
    # No build isolation and no dependencies: the machine's setuptools, nothing downloaded.
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                           "--target", str(target), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (target / "dancegrpo" / "assets" / "prompts.txt").is_file()
    for family in ("flux", "qwenimage"):
        shipped = target / "dancegrpo" / "assets" / "digits" / family
        assert (shipped / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
        assert len(list((shipped / "data" / "prompt_embed").glob("*.pt"))) == 40
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    modules = ("jagg_patch.tools.compare", "dancegrpo.train_grpo_flux", "dancegrpo.train_grpo_qwenimage",
               "dancegrpo.evaluate", "jagg_patch", "jagg_patch.upstream")
    helps = {module: subprocess.Popen([sys.executable, "-m", module, "--help"], cwd=elsewhere, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for module in modules}
    for module, proc in helps.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "usage" in out.lower(), (module, err[-2000:])
    where = subprocess.run([sys.executable, "-c", "import dancegrpo, jagg_patch; print(dancegrpo.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120).stdout
    assert where.startswith(str(target)), where
