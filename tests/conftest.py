import pytest

pytest_plugins = ["pytester"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA exists; elsewhere they are skipped cleanly."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
