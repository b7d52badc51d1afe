"""The LoRA flags (upstream's train_grpo_flux_lora.py), apart from the adapter code so that the
command line is built without torch or peft."""


def add_lora_args(parser):
    g = parser.add_argument_group("LoRA (upstream's train_grpo_flux_lora.py)")
    g.add_argument("--use_lora", action="store_true", help="Train a LoRA adapter; the base weights stay frozen.")
    g.add_argument("--lora_rank", type=int, default=128)
    g.add_argument("--lora_alpha", type=int, default=256)
    g.add_argument("--lora_target_modules", type=str, default="to_q,to_k,to_v,to_out.0",
                   help="Comma list of module names (suffixes) that get an adapter.")
    g.add_argument("--resume_from_lora_checkpoint", type=str, default=None,
                   help="Upstream's name: resume a LoRA run from this checkpoint folder ('latest' works too); "
                        "the same as --resume_from_checkpoint.")
    g.add_argument("--lora_save_merged", action="store_true",
                   help="Also write merged/ (base + adapter as one transformer folder) into each checkpoint.")


def validate_lora_args(args):
    if args.resume_from_lora_checkpoint:
        if args.resume_from_checkpoint and args.resume_from_checkpoint != args.resume_from_lora_checkpoint:
            raise ValueError("--resume_from_lora_checkpoint and --resume_from_checkpoint name different folders; "
                             "give one of them")
        args.use_lora = True
        args.resume_from_checkpoint = args.resume_from_lora_checkpoint
    if not args.use_lora:
        return
    if args.lora_rank < 1 or args.lora_alpha <= 0:
        raise ValueError("--lora_rank must be >= 1 and --lora_alpha > 0 (upstream: 128 and 256)")
    if not target_modules(args):
        raise ValueError("--lora_target_modules is empty (upstream: to_q,to_k,to_v,to_out.0)")


def target_modules(args):
    return [m.strip() for m in args.lora_target_modules.split(",") if m.strip()]
