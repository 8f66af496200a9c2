"""Tools for examples/recipes/quickstart_tools_grpo.yaml (rl.tools): plain Python functions with type hints and a
Google-style docstring (an `Args:` line per argument), which is what TRL's tool loop and transformers'
`get_json_schema` need to describe them to the model in the chat template's `tools`."""


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
