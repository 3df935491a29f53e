"""kvlens_oracle: an independent float64 PyTorch reference for kvlens (no kvlens imports)."""
from .container import read_container, write_container
from .loader import OracleModel, load_model
from .model import forward, greedy, positions_per_document
from .spm import SpmTokenizer

__all__ = ["OracleModel", "load_model", "forward", "greedy", "positions_per_document",
           "SpmTokenizer", "read_container", "write_container"]
