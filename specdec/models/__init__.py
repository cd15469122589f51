"""Model definitions the library loads, each with its on-disk format and loader.

- :mod:`specdec.models.draft`: the reduced-head draft (``ReducedHeadLlamaForCausalLM``,
  ``load_draft`` / ``save_draft``); ``runner.load_model`` loads a directory carrying its marker.
- :mod:`specdec.models.exit_adapter`: the early-exit adapter (``ExitAdapter``,
  ``load_exit_adapter`` / ``save_exit_adapter``) for the ``early_exit`` drafter.
- :mod:`specdec.models.files`: the file names of both directories (standard library only, so a
  cache check needs no torch).

How the demo builds and trains them is :mod:`specdec.demo`'s business; nothing here imports it.
This package imports no submodule, so importing ``specdec.models.files`` loads no torch.
"""
