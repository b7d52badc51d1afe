"""What the per-model preprocessing scripts share: the command line, prompt
reading, per-rank sharding under torchrun, and resume-safe writes.

Layout written into --output_dir (what `dancegrpo.utils.data.PromptEmbeddingDataset` reads):

    <output_dir>/videos2caption.json           [{"caption": ..., "<field>": "<file>.pt", ...}, ...]
    <output_dir>/<subfolder>/<file>.pt         one tensor per prompt and embedding kind

Resume safety: every .pt goes to a temp file in the same folder and is renamed
into place (os.replace is atomic), so a file under its final name is always
complete. An item counts as done when all its files exist; a re-run skips done
items. File names carry the prompt's line index and a hash of its text, so an
edited prompt file is never matched with stale embeddings. The JSON index is
written last, by rank 0 after every rank finished, also through a rename.
"""
import glob
import hashlib
import json
import os

from ..errors import say
from ..utils.command_line import CommandParser

# torch and the collectives load in the functions that use them: --help and a flag error answer first.

INDEX_NAME = "videos2caption.json"  # upstream's name, which the training scripts point at


def build_parser(model, description, default_max_sequence_length):
    p = CommandParser(prog=f"python -m dancegrpo.preprocess.{model}", description=description)
    p.add_argument("--model_path", required=True,
                   help="Local diffusers model folder; only its text encoder(s) and tokenizer(s) are loaded.")
    p.add_argument("--prompt_dir", "--prompt_file", dest="prompt_dir", required=True,
                   help="Text file with one prompt per line (blank lines are skipped). Upstream's flag name.")
    p.add_argument("--output_dir", default=os.path.join("data", f"{model}_rl_embeddings"),
                   help=f"Where the embeddings and {INDEX_NAME} go (default: a folder of its own per model).")
    p.add_argument("--batch_size", type=int, default=8, help="Prompts per text-encoder call.")
    p.add_argument("--max_sequence_length", type=int, default=default_max_sequence_length,
                   help="Text tokens kept per prompt (and padded to, where the model pads).")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="Text-encoder dtype and saved dtype; auto: bfloat16 on GPU, float32 on CPU.")
    return p


def fail(message):
    """Bad input: a message that names the fix, non-zero exit."""
    say(f"error: {message}")
    raise SystemExit(2)


def read_prompts(path):
    """Non-blank lines, stripped, in file order (with their position among the prompts)."""
    if not os.path.isfile(path):
        fail(f"prompt file {path!r} does not exist; pass a text file with one prompt per line to --prompt_dir")
    with open(path, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        fail(f"prompt file {path!r} holds no prompts (only blank lines); put one prompt per line in it")
    return prompts


def require_components(model_path, subfolders, hint):
    if not os.path.isdir(model_path):
        fail(f"model folder {model_path!r} does not exist; {hint}")
    missing = [s for s in subfolders if not os.path.isdir(os.path.join(model_path, s))]
    if missing:
        fail(f"model folder {model_path!r} lacks {', '.join(s + '/' for s in missing)}; {hint}")


def item_name(index, prompt):
    return f"{index:06d}-{hashlib.sha1(prompt.encode('utf-8')).hexdigest()[:10]}.pt"


def atomic_torch_save(tensor, path):
    import torch
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(tensor.detach().cpu().contiguous().clone(), tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_json(obj, path):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
    os.replace(tmp, path)


def resolve_dtype(name, device):
    import torch
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def main_for(family, argv=None):
    """The prompt-embedding writer of a registered family: its encoder (the family package's
    preprocess part), this module's command line and resume-safe run."""
    from ..models.registry import family_part
    spec = family_part(family, "preprocess").ENCODER
    parser = build_parser(family, spec.description, spec.default_max_sequence_length)
    return run(parser.parse_args(argv), spec)


def run(args, spec):
    """Encode every pending prompt of this rank and write the index.

    spec: a family's encoder (dancegrpo/models/<family>/preprocess.py's ENCODER), with
      subfolders: {kind: (json_field, subfolder)}
      components, hint: the model folder's sub-folders it reads, and where to get them
      check_args(args) -> None, or what is wrong with the flags for this model
      load(args, device, dtype) -> encoder state
      encode(state, prompts, args) -> list (one per prompt) of {kind: tensor}
      index_fields({kind: path}) -> extra JSON fields of one finished item (e.g. original_length)
    Returns the list of index entries (rank 0) or None.
    """
    import torch
    from tqdm.auto import tqdm

    from ..utils.communications import barrier, init_distributed, shutdown
    prompts = read_prompts(args.prompt_dir)
    require_components(args.model_path, spec.components, spec.hint)
    problem = spec.check_args(args)
    if problem:
        fail(problem)
    if args.batch_size < 1:
        fail("--batch_size must be >= 1")
    rank, world_size, _, device = init_distributed()
    for _, sub in spec.subfolders.values():
        os.makedirs(os.path.join(args.output_dir, sub), exist_ok=True)

    names = [item_name(i, p) for i, p in enumerate(prompts)]
    paths = [{kind: os.path.join(args.output_dir, sub, name) for kind, (_, sub) in spec.subfolders.items()}
             for name in names]
    def done(i):
        return all(os.path.isfile(p) for p in paths[i].values())

    mine = [i for i in range(len(prompts)) if i % world_size == rank]
    for i in mine:  # temp files of a killed earlier run (never under a final name)
        for path in paths[i].values():
            for stale in glob.glob(glob.escape(path) + ".tmp-*"):
                os.remove(stale)
    pending = [i for i in mine if not done(i)]
    skipped = len(mine) - len(pending)
    state = spec.load(args, device, resolve_dtype(args.dtype, device)) if pending else None
    bar = tqdm(total=len(mine), initial=skipped, desc=f"encode (rank {rank})", disable=rank != 0, unit="prompt")
    for start in range(0, len(pending), args.batch_size):
        chunk = pending[start:start + args.batch_size]
        with torch.no_grad():
            outputs = spec.encode(state, [prompts[i] for i in chunk], args)
        for i, tensors in zip(chunk, outputs):
            for kind, tensor in tensors.items():
                atomic_torch_save(tensor, paths[i][kind])
            bar.update(1)
    bar.close()

    barrier()
    entries = None
    if rank == 0:
        missing = [prompts[i] for i in range(len(prompts)) if not done(i)]
        if missing:
            fail(f"{len(missing)} prompts have no embeddings (e.g. {missing[0]!r}); re-run the same command to finish")
        entries = []
        for i, prompt in enumerate(prompts):
            entry = {"caption": prompt}
            entry.update({field: names[i] for field, _ in spec.subfolders.values()})
            entry.update(spec.index_fields(paths[i]))
            entries.append(entry)
        atomic_write_json(entries, os.path.join(args.output_dir, INDEX_NAME))
        print(f"{len(prompts)} prompts -> {os.path.join(args.output_dir, INDEX_NAME)} "
              f"(rank 0 encoded {len(pending)}, found {skipped} already done)", flush=True)
    shutdown()
    return entries
