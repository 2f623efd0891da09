"""Native code: the staged chunk loop, the planner's id validator and the one-call
transfer, in C (``src/``), and what binds and checks them.

``src/`` holds the C by concern (validate, layout, issue, queue, transfer, report; the
header ``codes.h`` is the one set of codes and limits, ``structs.h`` the structs Python
mirrors). ``build`` compiles it at first use (the only module that runs a compiler);
``library`` binds it and refuses it unless the mirrors of its structs (``structs``) and
of its constants (``codes``) agree with what the C reports. ``validator`` is the
planner's accelerator (``tc_validate``); ``chunk_loop`` is the issuing thread the
``staged`` backend hands block plans to; ``transfer_call`` is what the one call per
transfer (``tc_transfer``) checks against. Torch-free; nothing here is imported by the
device layer or the region.
"""
