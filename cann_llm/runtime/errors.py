"""ATC-style error codes: the real ATC's codes and message templates (shared/reference/ATC.md §1.7).

Every failure the user can cause is an `AtcError` carrying a code; the CLI prints it in ATC's layout
(`E10016: [PID: n] <timestamp> <message>` plus indented `Possible Cause:`/`Solution:` lines) and exits
with 255, as ATC does. Anything else is an internal error (E19999).
"""

from __future__ import annotations

import os
import time

TEMPLATES: dict[str, str] = {
    "E10001": "Value {0} for parameter {1} is invalid. Reason: {2}",
    "E10002": "Value {0} for parameter --input_shape is invalid. Reason: {1}. The value must be formatted as {2}.",
    "E10004": "Value for --{0} is empty.",
    "E10005": "Value {0} for parameter --{1} is invalid. The value must be either true or false.",
    "E10006": "Value {0} for parameter --{1} is invalid. The value must be either 1 or 0.",
    "E10007": "--{0} is required. The value must be {1}.",
    "E10009": "--dynamic_batch_size, --dynamic_image_size, --input_shape_range, and --dynamic_dims are mutually "
              "exclusive.",
    "E10010": "Value {0} for parameter --log is invalid.",
    "E10011": "Value {0} for parameter --input_shape is invalid. Shape values must be positive integers. "
              "The error value in the shape is {1}.",
    "E10018": "Value {0} for parameter --input_shape is invalid. Reason: with --dynamic_batch_size only dimension 0 "
              "(the batch) may be -1.",
    "E10016": "Op name {0} specified in --{1} is not found in the model. Confirm whether this node name exists, "
              "or whether the node is not split with the specified delimiter ';'.",
    "E10031": "Value {0} for parameter --input_shape is invalid. Reason: --dynamic_batch_size needs -1 at dimension "
              "0 of the inputs it varies.",
    "E10032": "Failed to parse JSON file {0}. Reason: {1}.",
    "E10035": "--{0} has {1} profiles, which is less than the minimum ({2}).",
    "E10036": "--{0} has {1} profiles, which is greater than the maximum ({2}).",
    "E10037": "Value {0} for parameter --{1} is invalid. Reason: every profile must have the same number of "
              "dimensions.",
    "E10038": "Value {0} for parameter --{1} is invalid. Reason: each dimension must be a positive integer.",
    "E10039": "Value {0} for parameter --{1} is invalid. Reason: profile {2} is given more than once.",
    "E10040": "Value {0} for parameter --input_shape is invalid. Reason: a range (~) cannot be combined with --{1}.",
    "E10021": "Path for parameter --{0} is too long. Keep the length within {1}.",
    "E10022": "Path {0} for parameter --{1} does not include the file name.",
    "E10041": "Failed to load the model from {0}.",
    "E10045": "Value {0} for parameter --dynamic_dims is invalid. Reason: each profile must give one value per -1 "
              "in --input_shape ({1} in {2}).",
    "E10047": "--{0} and --{1} are mutually exclusive.",
    "E10049": "Dimension count {0} configured in --input_shape does not match dimension count {1} of the node.",
    "E10054": "The required parameter {0} for ATC is empty. Another possible reason is that the values of some "
              "parameters are not enclosed by quotation marks (\"\").",
    "E10055": "The operation is not supported. Reason: {0}.",
    "E13001": "Failed to open file {0}. Reason: {1}.",
    "E13004": "Failed to write file {0}. Reason: {1}.",
    "E13015": "Model file {0} is invalid. Reason: {1}.",
    "E13016": "Model file {0} cannot run on this host. Reason: {1}.",
    "E13017": "The deployment on the Ray cluster at {0} failed. Reason: {1}.",
    "E16002": "No ONNX parser is registered for optype {0}.",
    "E16004": "ONNX model has no graph.",
    "E19999": "Unknown error occurred. Please check the log.",
}

SOLUTIONS: dict[str, str] = {
    "E10001": "Try again with a valid argument.",
    "E10002": "Try again with a valid --input_shape argument.",
    "E10016": "Check the names of the model's inputs and outputs (atc --mode=1 dumps them).",
    "E10041": "Check that the file is an ONNX model exported completely, with its external data beside it.",
    "E13001": "Check that the file exists and can be read.",
    "E13004": "Check that the output directory exists and can be written.",
    "E13015": "Compile the model again with atc; a copy may have been truncated or altered.",
    "E13016": "Run it on a host that has what it needs, or compile it again for this one.",
    "E13017": "Check that every node can read the model files and has the CPUs asked for (ray status).",
    "E16002": "Run atc --mode=3 to list every unsupported operator, then replace them in the model.",
}


class AtcError(Exception):
    """A user-facing failure with an ATC error code; `reason` lines go under `TraceBack`."""

    def __init__(self, code: str, *args: object, reason: str | None = None):
        self.code = code
        self.message = TEMPLATES[code].format(*args)
        self.reason = reason
        super().__init__(f"{code}: {self.message}")

    def __reduce__(self):  # pickled whole (multiprocessing, copy): not formatted again from its template
        return _restored, (self.code, self.message, self.reason), self.__dict__

    def render(self) -> str:
        """The message block ATC prints after its failure banner."""
        now = time.time()
        stamp = time.strftime("%Y-%m-%d-%H:%M:%S", time.localtime(now)) + f".{int(now * 1e6) % 1000000:06d}"
        lines = [f"{self.code}: [PID: {os.getpid()}] {stamp} {self.message}"]
        if self.code in SOLUTIONS:
            lines.append(f"        Solution: {SOLUTIONS[self.code]}")
        if self.reason:
            lines.append("        TraceBack (most recent call last):")
            lines += [f"        {line}" for line in self.reason.splitlines()]
        return "\n".join(lines)


def _restored(code: str, message: str, reason: str | None) -> AtcError:
    error = AtcError.__new__(AtcError)
    error.code, error.message, error.reason = code, message, reason
    Exception.__init__(error, f"{code}: {message}")
    return error


def invalid_value(value: object, flag: str, reason: str) -> AtcError:
    """E10001 for `--flag=value`, the most common refusal."""
    return AtcError("E10001", value, f"--{flag}", reason)


def not_in_range(value: object, flag: str, allowed) -> AtcError:
    """E10001 with ATC's range wording."""
    choices = " ".join(f"[{a}]" for a in allowed)
    return invalid_value(value, flag, f"The value is not within the range of values. The valid range is {choices} .")
