"""The one error class of data preprocessing: raised for bad input, printed as ``error: ...``."""


class PreprocessError(Exception):
    """Bad input or arguments. The message says what, where (file, line/row, field) and how to fix it."""
