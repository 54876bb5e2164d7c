package projection

import (
	"fmt"
	"strconv"

	"github.com/verity-go/verity/outbox"
)

// SortedSetMapper projects every record into the sorted set named
// collection: the member is the record's Key, the version its Version and
// the score its Payload, a base-10 int64 such as "17" or "-3" (a bare JSON
// integer qualifies). Any other payload is refused with ErrInvalidPayload.
func SortedSetMapper(collection string) Mapper {
	return MapperFunc(func(rec outbox.Record) (Write, error) {
		score, err := strconv.ParseInt(string(rec.Payload), 10, 64)
		if err != nil {
			return Write{}, fmt.Errorf("%w: sorted-set score %q is not a base-10 int64", ErrInvalidPayload, truncate(rec.Payload))
		}
		return Write{
			Target:  Target{Kind: KindSortedSet, Name: collection, Member: rec.Key},
			Version: rec.Version,
			Value:   Value{Score: score},
		}, nil
	})
}

// HashMapper projects every record into the hash named collection: the
// field is the record's Key and the value its Payload, verbatim.
func HashMapper(collection string) Mapper {
	return MapperFunc(func(rec outbox.Record) (Write, error) {
		return Write{
			Target:  Target{Kind: KindHash, Name: collection, Member: rec.Key},
			Version: rec.Version,
			Value:   Value{Data: rec.Payload},
		}, nil
	})
}

// DocumentMapper projects every record into its own document whose id is
// namespace + the record's Key, holding the Payload verbatim (typically
// JSON). Use a distinct namespace per stream so keys of different streams
// cannot meet.
func DocumentMapper(namespace string) Mapper {
	return MapperFunc(func(rec outbox.Record) (Write, error) {
		return Write{
			Target:  Target{Kind: KindDocument, Name: namespace + rec.Key},
			Version: rec.Version,
			Value:   Value{Data: rec.Payload},
		}, nil
	})
}

// StreamMapper routes each record to the Mapper registered for its Stream.
// A record of any other stream fails to map with ErrUnmappedStream.
type StreamMapper map[string]Mapper

// Map calls the Mapper of rec.Stream.
func (m StreamMapper) Map(rec outbox.Record) (Write, error) {
	mapper, ok := m[rec.Stream]
	if !ok || mapper == nil {
		return Write{}, fmt.Errorf("%w %q", ErrUnmappedStream, rec.Stream)
	}
	return mapper.Map(rec)
}

var _ Mapper = StreamMapper(nil)

// truncate shortens a payload for an error message.
func truncate(b []byte) string {
	const limit = 64
	if len(b) > limit {
		return string(b[:limit]) + "…"
	}
	return string(b)
}
