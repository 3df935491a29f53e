"""kvlens: a Python client for kvlens-server (kvlens.v1 Generation and Interpret), with
plotting helpers (kvlens.plot) for attention heatmaps, saliency bars and head-score grids.

    from kvlens import Client
    c = Client("127.0.0.1:50051")
    maps = c.attention_maps(text="In the beginning", layers=[0], heads=[0, 1])
    maps.probs.shape   # (layers, heads, queries, keys)
"""
from kvlens.client import (ActivationCache, AttentionMaps, CachedKvProbe, Client,  # noqa: F401
                           Generation, GradientProbe, PatchSweep, PromptScores, StreamChunk,
                           get_act_name)
