"""Drop-in use from training frameworks: each module adapts one framework's checkpoint hooks to a Client."""
