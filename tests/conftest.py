import pytest


@pytest.fixture(scope="session")
def tiny():
    """One tiny random target for the whole session (built in-process, ~0.2 s)."""
    from pipeline.target import load_target

    return load_target("tiny-random", progress=False)
