"""A request's options and their validation, on plain types: the client API's half of the
request contract, imported by the router, the offline `LLM` and `SamplingParams` alike
(nothing here imports a service, gRPC or torch).

- `validation.py`: the options (`SamplingOptions`, `StoppingOptions`), the served model's
  limits and `validate` / `check_options`, the data plane's ranges and messages;
- `fields.py`: reading options from plain data (a JSON body, a `SamplingParams`), each
  field's type and wire range;
- `constraint.py`: structured output (`OutputConstraint`) from OpenAI's and vLLM's fields.
"""
