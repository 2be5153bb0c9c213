"""The error every step of flashmoe-cli convert raises: the input checkpoint or the destination is unusable.

Reading headers, planning and writing the store all raise it, and the CLI turns it into one line
for the user, so it lives apart from all three.
"""


class CheckpointError(Exception):
    """The input checkpoint (or the destination) is unusable; the message says what and what to do."""
