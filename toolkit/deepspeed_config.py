"""DeepSpeed configs as users bring them: resolve "auto" from the recipe, refuse contradictions."""
