# Sourced by the device session scripts. A job started in the background runs from a copy of
# the working tree: each call of the device tool replaces the tree in place, and a job that
# imported a module meanwhile died (ModuleNotFoundError: pipeline.data.tokens, the 16-layer
# MoE run, H100 2026-12-06 18:52). The carries (.devstash*, .whl, .benchcache) stay behind:
# `stage` takes them from the tree itself.
freeze_tree() {  # cd into a fresh copy of the tree under $S/trees
  local d
  d="$S/trees/$(date +%s%N)"
  mkdir -p "$d" && tar cf - --exclude='./.devstash*' --exclude=./.whl --exclude=./.git \
    --exclude=./.benchcache . | tar xf - -C "$d" && cd "$d" || exit 1
}
