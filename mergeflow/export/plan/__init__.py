"""Planning an export from metadata alone: the pre-flight's refusals, the target schema, the MergePlan."""
