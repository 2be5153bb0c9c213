"""The store's one exception type, shared by the writer, the queries and the CLI."""


class StoreError(RuntimeError):
    """The store file cannot be used; the message names the file, the reason and what to do."""
