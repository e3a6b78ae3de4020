# Stand-in for IPython in the SGLang tests (avoids ~15 extra packages): sglang/utils.py (0.5.23) does only
# `from IPython.display import HTML, display`, for notebook pretty-printing.
