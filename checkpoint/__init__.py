"""Checkpoint format shared by training, inference and tools: folder layout and verification
(`format`), layout-free keys (`keys`), and reading/writing model weights without a trainer
(`model_io`). Nothing here imports training/ or inference/."""
