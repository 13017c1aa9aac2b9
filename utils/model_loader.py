"""Kept so that the documented `from utils.model_loader import load_model` goes on working; the loader lives in
`utils/models/model_loader.py`."""

from utils.models.model_loader import *  # noqa: F401,F403
