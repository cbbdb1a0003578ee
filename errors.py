class InputError(Exception):
    """A problem with what the user gave us (paths, files, flags). The CLI prints it as one line and exits 2."""


class ChatError(InputError):
    """A conversation or chat template this project cannot render; the message names the value."""
