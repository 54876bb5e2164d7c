-- versions.lua: prepended to read.lua and bump.lua, which read versions
-- that may have been left by anything (a foreign writer, a hand edit).
--
-- version returns text as a number when it is a version these scripts
-- could have written: decimal digits without a leading zero, below 2^53,
-- where Lua's doubles (tonumber) still hold every integer and its
-- successor. Anything else, a foreign or corrupt value, is no version: nil.
local function version(text)
  if not text or #text > 16 or not string.find(text, '^%d+$') then
    return nil
  end
  if #text > 1 and string.sub(text, 1, 1) == '0' then
    return nil
  end
  local v = tonumber(text)
  if v >= 9007199254740992 then
    return nil
  end
  return v
end
