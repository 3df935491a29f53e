# launch_bounds.awk (run by translate_cu.sh): moves each kernel's __launch_bounds__(ARGS)
# from its declaration into its body, as the body's first statement,
#   if (::kvlens_emu::ExceedsLaunchBounds(ARGS)) return;
# where the emulator evaluates ARGS with the kernel's template arguments and refuses a
# launch of a larger block, as a GPU does (emu_device.h). The statement goes on the line of
# the body's opening brace and the arguments' line breaks stay where they were, so every
# line keeps its number. Only a declaration whose line holds `__global__` (and no `//`) is
# moved; any other mention is left to emu_device.h's empty macro. A `//` comment among the
# arguments is dropped (they end up on one line). Fails on unbalanced
# parentheses or a declaration without a body.
{ src = src $0 "\n" }
END {
  key = "__launch_bounds__("
  out = ""
  while ((i = index(src, key)) > 0) {
    head = substr(src, 1, i - 1)
    src = substr(src, i + length(key))
    line = head
    while ((n = index(line, "\n")) > 0) line = substr(line, n + 1)
    if (index(line, "__global__") == 0 || index(line, "//") > 0) {
      out = out head key
      continue
    }
    out = out head
    depth = 1
    args = ""
    breaks = ""
    while (1) {
      if (src == "") {
        print "launch_bounds.awk: unbalanced parentheses after __launch_bounds__" > "/dev/stderr"
        exit 1
      }
      c = substr(src, 1, 1)
      src = substr(src, 2)
      if (c == "/" && substr(src, 1, 1) == "/") {  # a comment: dropped to the line's end
        n = index(src, "\n")
        src = substr(src, n)
        continue
      }
      if (c == "(") depth++
      if (c == ")" && --depth == 0) break
      if (c == "\n") {
        breaks = breaks "\n"
        args = args " "
      } else {
        args = args c
      }
    }
    brace = index(src, "{")
    semi = index(src, ";")
    if (brace == 0 || (semi > 0 && semi < brace)) {
      print "launch_bounds.awk: a __launch_bounds__ kernel without a body" > "/dev/stderr"
      exit 1
    }
    out = out breaks substr(src, 1, brace) " if (::kvlens_emu::ExceedsLaunchBounds(" args ")) return;"
    src = substr(src, brace + 1)
  }
  printf "%s", out src
}
