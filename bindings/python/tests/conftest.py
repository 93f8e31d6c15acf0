import pytest

import mlxcel


@pytest.fixture(scope="session")
def model() -> mlxcel.Model:
    """The default model (SmolLM2-135M-Instruct), loaded once."""
    return mlxcel.load()
