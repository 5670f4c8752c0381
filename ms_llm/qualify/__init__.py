"""``ms-llm qualify``: run every model family under every layout/feature as real jobs and publish
which cells meet the criteria of docs/qualification.md (support.md / support.json)."""
