"""The errors of data preprocessing: raised for bad input, printed as ``error: ...``.

Policy for rows (one place, every handler and template path uses it):

* :class:`RowError`: one row is malformed (a missing field, a wrong type, an unknown role,
  unparseable tool arguments, ...). By default the run stops with one ``error:`` line naming
  the file, the row and the field; under ``--skip-bad-rows`` the row is skipped and counted
  under its ``reason`` in the summary and the sidecar.
* Rows that are well-formed but unusable (roles out of order, no answer, no trained token)
  are skipped and counted by reason without any flag, as MindSpeed-LLM does.
* :class:`PreprocessError` (not a row's fault: arguments, files, tokenizer) always stops the run.
"""


class PreprocessError(Exception):
    """Bad input or arguments. The message says what, where (file, line/row, field) and how to fix it."""


class RowError(PreprocessError):
    """One malformed row. ``reason`` is the short skip reason counted under ``--skip-bad-rows``."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # raised in a worker process, re-raised in the main one
        return type(self), (str(self), self.reason)

    def at(self, where: str) -> "RowError":
        """This error prefixed with the row's location ``where``, once: a nested reader may have named it already."""
        if str(self).startswith(f"{where}: "):
            return self
        return RowError(f"{where}: {self}", self.reason)


SKIP_BAD_ROWS_HINT = "pass --skip-bad-rows to skip such rows and count them by reason"
# RowError reasons of the readers and handlers
BAD_JSON = "malformed JSON"
BAD_CSV = "malformed CSV row"
BAD_MISSING_FIELD = "missing field"
BAD_TYPE = "wrong type"
BAD_ROLE = "unknown role"
