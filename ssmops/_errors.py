"""Errors shared by the export paths (torch.export / AOTInductor, ONNX), apart from both."""


class ExportError(RuntimeError):
    """A model could not be exported; the message names the failing submodule and why."""
