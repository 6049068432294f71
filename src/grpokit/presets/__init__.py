"""The built-in presets: YAML configs shipped with the package (addition, gsm8k, tool_addition, ...)."""
