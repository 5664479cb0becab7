"""Built-in backends. Out-of-tree backends follow the same shape (see the package README)."""
