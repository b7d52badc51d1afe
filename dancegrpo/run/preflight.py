"""What a training run checks before it claims its output folder and before anything loads (rank 0):
a wrong or damaged file is named in one line in seconds, not found after the reward model and the
transformer have loaded, or steps later, as a traceback."""
from ..utils.data import PromptEmbeddingDataset


def preflight(args, family):
    """The model folders are this family's and whole; every prompt-embedding file the data JSON names
    exists, reads, and has the family's layout for this transformer."""
    config = family.check_files(args)
    dataset = PromptEmbeddingDataset(args.data_json_path, family.embedding_fields)
    dataset.check_layout(family.embedding_layout(config), args.data_json_path)
