"""Prompt file -> precomputed text embeddings in the layout the trainers read.

    python -m dancegrpo.preprocess.flux      --model_path data/flux       --prompt_dir prompts.txt
    python -m dancegrpo.preprocess.qwenimage --model_path data/qwenimage  --prompt_dir prompts.txt
    torchrun --nproc_per_node=8 -m dancegrpo.preprocess.qwenimage ...   (items split over ranks)
    python -m dancegrpo.preprocess --family NAME ...                     (any registered family)

Each model writes into its own folder (upstream's two scripts wrote the same
file names into one folder) and uses the text encoders at --model_path
(upstream ignored it). See `common.py` for the resume-safe write; each family's writer is its
package's (dancegrpo/models/<family>/preprocess.py).
"""
