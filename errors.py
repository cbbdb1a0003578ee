class InputError(Exception):
    """A problem with what the user gave us (paths, files, flags). The CLI prints it as one line and exits 2."""
